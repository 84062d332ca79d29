"""One layer's paged KV cache, as the attention backends and kernels read and write it."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKVCache:
    """K and V of every block, and with a quantized format their scales, indexed alike::

        k, v:              (num_blocks, block_size, kv_heads, head_dim)  model dtype, int8, e4m3
        k_scale, v_scale:  (num_blocks, block_size, kv_heads)            float16, or None

    Slot s is row s % block_size of block s // block_size in all four, so a block's scales
    travel with its block id (kvstore/kv_format.py).

    key_rotation (head_dim, head_dim), model dtype, or None: the cache holds keys times this
    matrix (after rotary), so whoever writes keys or attends over them rotates k and q by it
    first (workers/attention/key_rotation.py); one tensor shared by every layer.

    key_center (kv_heads, head_dim), model dtype, or None: the keys are stored less this
    layer's center, before any rotation (workers/attention/key_centers.py); queries are not
    (softmax is blind to it)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    key_rotation: torch.Tensor | None = None
    key_center: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("K and V are quantized together or not at all")
        if self.k_scale is not None and self.k_scale.shape != self.k.shape[:3]:
            raise ValueError(f"scales of shape {tuple(self.k_scale.shape)} do not match a "
                             f"cache of shape {tuple(self.k.shape)}")
        head_dim = self.k.shape[3]
        if self.key_rotation is not None and self.key_rotation.shape != (head_dim, head_dim):
            raise ValueError(f"a key rotation of shape {tuple(self.key_rotation.shape)} does "
                             f"not fit head_dim {head_dim}")
        if self.key_center is not None:
            if not self.quantized:
                raise ValueError("keys are centered only in a quantized cache")
            if self.key_center.shape != self.k.shape[2:]:
                raise ValueError(f"a key center of shape {tuple(self.key_center.shape)} does "
                                 f"not fit {self.k.shape[2]} kv heads of head_dim {head_dim}")

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]
