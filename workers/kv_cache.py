"""Sizing and allocating the paged KV cache of one worker."""

import torch
from transformers import PretrainedConfig

from workers.models.llama import kv_cache_shape_per_layer, num_layers

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_bytes_per_block(
    config: PretrainedConfig, tp_size: int, block_size: int, dtype: torch.dtype
) -> int:
    """2 (K and V) x layers x local kv heads x head_dim x bytes, for block_size tokens."""
    kv_heads, head_dim = kv_cache_shape_per_layer(config, tp_size)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers(config) * kv_heads * head_dim * element * block_size


def allocate_kv_caches(
    config: PretrainedConfig,
    tp_size: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCaches:
    kv_heads, head_dim = kv_cache_shape_per_layer(config, tp_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device),
         torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers(config))
    ]
