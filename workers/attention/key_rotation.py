"""Hadamard-rotated keys of a quantized KV cache (the why: kvstore/kv_format.py).

After rotary, each key head k and each query head q become k @ H and q @ H, H the normalized
Sylvester Hadamard matrix of order head_dim::

    H_1 = [1],  H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2)

H is symmetric and orthonormal (H @ H = I), so (q @ H) . (k @ H) = q . k: the attention
kernels, which only form q . k and weigh the values (never rotated), need no change, and the
cache's keys are rotated before they are quantized. Unfused, one (head_dim x head_dim)
matmul on the step's q rows and one on its k rows; fused, the attention-input kernel turns
each head in registers by a Walsh-Hadamard transform (workers/layers/attention_input.py).
"""

import math

import torch

from kvstore.kv_format import KVFormat


def hadamard(n: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order n (a power of two): (n, n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix has a power-of-two order, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    # built in float64, scaled once: entries +-n**-0.5, each the nearest value of dtype
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def key_rotation(fmt: KVFormat, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor | None:
    """The matrix a cache of ``fmt`` rotates keys and queries by, in the model's ``dtype``;
    None when it stores them as they are (``auto``, or a head_dim that is no power of two)."""
    return hadamard(head_dim, dtype, device) if fmt.rotates_keys(head_dim) else None


def rotate(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """x (..., head_dim) @ rotation; x itself when there is none."""
    return x if rotation is None else x @ rotation


def stored_keys(k: torch.Tensor, cache) -> torch.Tensor:
    """k (T, kv_heads, head_dim) as ``cache`` (a LayerKVCache) stores it: less the layer's
    center if it has one (workers/attention/key_centers.py), then rotated."""
    if cache.key_center is not None:
        k = k - cache.key_center
    return rotate(k, cache.key_rotation)
