"""Sizing and allocating the paged KV cache of one worker, in the format kv_cache_dtype names
(kvstore/kv_format.py): the model's dtype, or int8 / fp8 elements with a float16 scale per
token and kv head beside each layer's K and V."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstore.kv_format import KVFormat, check_device_supports
from kvstore.kv_format import kv_format as format_named
from workers.attention.key_rotation import key_rotation
from workers.attention.kv_quant import SCALE_DTYPE, element_dtype
from workers.attention.layer_cache import LayerKVCache
from workers.models.llama import kv_cache_shape_per_layer, num_layers

if TYPE_CHECKING:  # transformers is imported where a config is read, not to run a shard
    from transformers import PretrainedConfig

KVCaches = list[LayerKVCache]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_kv_format(name: str, dtype: torch.dtype, device: torch.device) -> KVFormat:
    """kv_cache_dtype ``name`` for a model of ``dtype`` on ``device``; ValueError at start-up
    for a name that is no format or a format the device cannot hold."""
    fmt = format_named(name, dtype_name(dtype))
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    check_device_supports(fmt, has_float8=hasattr(torch, "float8_e4m3fn"),
                          cuda_capability=capability)
    return fmt


def kv_bytes_per_block(
    config: PretrainedConfig, tp_size: int, block_size: int, dtype: torch.dtype,
    kv_format: KVFormat | None = None,
) -> int:
    """2 (K and V) x layers x local kv heads x (head_dim x bytes + scale bytes), for block_size
    tokens; kv_format None: elements of the model's ``dtype``, no scales."""
    kv_heads, head_dim = kv_cache_shape_per_layer(config, tp_size)
    fmt = kv_format or unquantized(dtype)
    return fmt.bytes_per_block(num_layers(config), kv_heads, head_dim, block_size)


def allocate_kv_caches(
    config: PretrainedConfig,
    tp_size: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_format: KVFormat | None = None,
    key_centers: list[torch.Tensor] | None = None,
) -> KVCaches:
    """Zeroed caches of every layer; kv_format None: elements of the model's ``dtype``. A
    format that rotates keys gets its matrix in every layer's ``key_rotation``; one that
    centers them each layer's center of ``key_centers`` (workers/attention/key_centers.py;
    None: uncalibrated, stored as they are)."""
    kv_heads, head_dim = kv_cache_shape_per_layer(config, tp_size)
    fmt = kv_format or unquantized(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    elements = element_dtype(fmt)
    rotation = key_rotation(fmt, head_dim, dtype, device)  # one matrix for every layer
    if key_centers is None or not fmt.centers_keys(head_dim):
        key_centers = [None] * num_layers(config)
    elif len(key_centers) != num_layers(config):
        raise ValueError(f"{len(key_centers)} key centers for {num_layers(config)} layers")

    # each kind one tensor over every layer, a layer's cache a view of it: the host tier
    # moves a batch of blocks of all layers in one gather (workers/block_copies.py)
    layers = len(key_centers)
    k, v = (torch.zeros((layers, *shape), dtype=elements, device=device) for _ in range(2))
    if not fmt.quantized:
        return [LayerKVCache(k[i], v[i]) for i in range(layers)]
    k_scale, v_scale = (torch.zeros((layers, *shape[:3]), dtype=SCALE_DTYPE, device=device)
                        for _ in range(2))
    return [LayerKVCache(k[i], v[i], k_scale[i], v_scale[i], rotation,
                         None if center is None else center.to(dtype=dtype, device=device))
            for i, center in enumerate(key_centers)]


def unquantized(dtype: torch.dtype) -> KVFormat:
    return format_named("auto", dtype_name(dtype))
