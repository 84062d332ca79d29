"""How a shard's host buffer holds KV blocks: every cache tensor's share of one block, back
to back in one slot (so a block is one contiguous run of bytes), and what the engine needs to
know of the buffer."""

import hashlib
import json
from dataclasses import dataclass

import torch

from workers.kv_cache import KVCaches


def layer_tensors(kv_caches: KVCaches) -> list[torch.Tensor]:
    """Every tensor of every layer's cache, each indexed by block id along dim 0: K and V
    today, and whatever else a layer's cache holds per block (a quantized cache's scales)."""
    return [tensor for layer in kv_caches
            for tensor in (layer.k, layer.v, layer.k_scale, layer.v_scale) if tensor is not None]


@dataclass(frozen=True)
class BlockLayout:
    """Where each cache tensor's share of one block sits in a slot's bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]  # bytes of one block of each tensor
    block_bytes: int
    tag: str  # names dtypes and shapes (and the tensor-parallel size): files of another differ

    @classmethod
    def of(cls, tensors: list[torch.Tensor], tp_size: int) -> "BlockLayout":
        offsets, sizes, offset = [], [], 0
        for tensor in tensors:
            if offset % tensor.element_size():
                raise ValueError(f"a {tensor.dtype} cache tensor would start at byte {offset} "
                                 "of a host slot, not a multiple of its element size")
            size = tensor[0].numel() * tensor.element_size()
            offsets.append(offset)
            sizes.append(size)
            offset += size
        described = json.dumps([tp_size] + [[str(t.dtype), list(t.shape[1:])] for t in tensors])
        tag = hashlib.sha256(described.encode()).hexdigest()[:16]
        return cls(tuple(offsets), tuple(sizes), offset, tag)

    def views(self, buffer: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's blocks inside a (slots, block_bytes) byte buffer, shaped as it is."""
        rows = buffer.shape[0]
        return [buffer[:, offset:offset + size].view(t.dtype).view(rows, *t.shape[1:])
                for offset, size, t in zip(self.offsets, self.sizes, tensors, strict=True)]


@dataclass(frozen=True)
class OffloadInfo:
    """What the engine needs of a shard's host buffer to keep its index."""

    num_slots: int
    block_bytes: int  # one slot, this shard's share of a block
    layout_tag: str  # the disk tier's subdirectory: blocks of this layout only
    # measured at start-up: what pricing copies against recomputes needs (router/kv_pricing.py)
    copy_bytes_per_s: float = 0.0  # device -> host, one staging batch
    prefill_tokens_per_s: float = 0.0
    load_bytes_per_s: float = 0.0  # what loading adds to a step (a GPU probe); 0: not measured
    store_seconds_per_block: float = 0.0  # what a block's store adds to a step (likewise)
