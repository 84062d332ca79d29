"""The fused attention input for a cache of rotated keys (workers/attention/key_rotation.py).

The attention-input kernel (attention_input.py) quantizes each k head as it stores it, but a
rotated cache must quantize k @ H, and H mixes all head_dim channels of a head, which that
kernel holds as two rotary halves. So the kernel runs as it is into a scratch cache of one
unquantized slot per token, and the rotation and the quantizing store follow::

    qkv -> attention_input -> q, scratch k, v  (normed, rotary; model dtype)
    q @ H                  -> q for the attention kernels
    (k - m) @ H, v         -> store_kv -> the quantized cache at the tokens' slots
                              (m: the layer's key center, where the cache has one)

Four launches more a layer than an unrotated cache (the slots, two small matmuls, the store),
all plain tensors of the step's size, so CUDA graphs capture them as they are. A padding
token (slot below 0) fills its scratch row and store_kv skips it.
"""

import torch

from workers.attention.key_rotation import rotate, stored_keys
from workers.attention.layer_cache import LayerKVCache
from workers.attention.triton_store import store_kv
from workers.layers.attention_input import attention_input


def rotated_attention_input(
    qkv: torch.Tensor,  # (T, (heads + 2 * kv_heads) * head_dim)
    num_heads: int,
    cos: torch.Tensor,  # (T, head_dim)
    sin: torch.Tensor,
    cache: LayerKVCache,  # with key_rotation
    slot_mapping: torch.Tensor,  # (T,) int64
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    row_scale: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """attention_input's q, rotated; k rotated and v stored (quantized) into ``cache``."""
    if cache.key_rotation is None:
        raise ValueError("rotated_attention_input needs a cache of rotated keys")
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = cache.k.shape[2], cache.k.shape[3]
    scratch = qkv.new_empty((2, num_tokens, 1, num_kv_heads, head_dim))  # K, V: slot = token
    slots = torch.arange(num_tokens, device=qkv.device)
    q = attention_input(qkv, num_heads, cos, sin, scratch[0], scratch[1], slots, q_norm, k_norm,
                        eps, row_scale)  # fmt: skip
    k, v = scratch[:, :, 0]  # each (T, kv_heads, head_dim)
    store_kv(stored_keys(k, cache), v, cache.k, cache.v, slot_mapping, cache.k_scale,
             cache.v_scale)
    return rotate(q, cache.key_rotation)
