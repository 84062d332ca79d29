"""One layer's paged KV cache, as the attention backends and kernels read and write it."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKVCache:
    """K and V of every block, and with a quantized format their scales, indexed alike::

        k, v:              (num_blocks, block_size, kv_heads, head_dim)  model dtype, int8, e4m3
        k_scale, v_scale:  (num_blocks, block_size, kv_heads)            float16, or None

    Slot s is row s % block_size of block s // block_size in all four, so a block's scales
    travel with its block id (kvstore/kv_format.py)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("K and V are quantized together or not at all")
        if self.k_scale is not None and self.k_scale.shape != self.k.shape[:3]:
            raise ValueError(f"scales of shape {tuple(self.k_scale.shape)} do not match a "
                             f"cache of shape {tuple(self.k.shape)}")

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]
