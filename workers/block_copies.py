"""A batch of KV blocks between the device cache and the rows of a staging buffer, whose
rows are host slots (workers/host_layout.py: every cache tensor's share of a block, back to
back): the device side of the host tier's copies.

A kernel per cache tensor would cost two or four launches a layer for every batch (~50 to
100 for a 24-layer model), host time that a small model's steps feel more than the bus's.
The caches of a kind are views of one tensor over every layer (workers/kv_cache.py), and in a
slot the layers' shares of that kind lie at a constant stride; so one gather (or scatter)
moves the batch's blocks of every layer of a kind, from the stacked tensor to a strided view
of the staging rows. A tensor that is no such view (an EAGLE head's features) is a group of
one.

Both move words, not bytes: the widest (8 bytes at most) that every offset and size of the
layout is a multiple of (as the in-place loads do, workers/pinned_copies.py), so the index
kernels handle 8x fewer elements for the same blocks.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

import torch

from workers.host_layout import BlockLayout


@dataclass(frozen=True)
class CopyGroup:
    cache: torch.Tensor  # (layers, num_blocks, bytes of one layer's block), uint8, contiguous
    offset: int  # where the first layer's share of a block starts in a slot
    stride: int  # bytes from one layer's share to the next one's in a slot
    first_position: int  # its first tensor's position in the list the layout was made of


WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_bytes(block_bytes: int, groups: Sequence[CopyGroup]) -> int:
    """The widest word (8 bytes at most) every offset and size of the layout, and where each
    cache starts in its storage, is a multiple of."""
    width = gcd(8, block_bytes)
    for group in groups:
        width = gcd(width, gcd(group.offset, gcd(group.stride, group.cache.shape[2])))
        width = gcd(width, group.cache.storage_offset())  # bytes: the caches are uint8 views
    return width


class BlockCopies:
    def __init__(self, tensors: list[torch.Tensor], layout: BlockLayout) -> None:
        self.block_bytes = layout.block_bytes
        self.groups = _groups(tensors, layout)
        self.width = word_bytes(self.block_bytes, self.groups)
        # each group's cache as (layers, blocks, words of a layer's block)
        self.words = [group.cache.view(WORDS[self.width]) for group in self.groups]

    def gather(self, block_index: torch.Tensor, rows: torch.Tensor) -> None:
        """The blocks ``block_index`` (on the cache's device) into ``rows`` (the first
        ``len(block_index)`` rows of a contiguous uint8 staging buffer), one kernel a group."""
        for group, cache in zip(self.groups, self.words, strict=True):
            torch.index_select(cache, 1, block_index, out=self._view(group, cache, rows))

    def scatter(self, block_index: torch.Tensor, rows: torch.Tensor) -> None:
        """``rows`` into the blocks ``block_index``: ``gather``'s inverse."""
        for group, cache in zip(self.groups, self.words, strict=True):
            cache.index_copy_(1, block_index, self._view(group, cache, rows))

    def _view(self, group: CopyGroup, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The group's words of ``rows`` as (layers, rows, words of a layer's block)."""
        layers, _, size = cache.shape
        width = self.width
        words = rows.view(WORDS[width])
        return words.as_strided((layers, rows.shape[0], size),
                                (group.stride // width, self.block_bytes // width, 1),
                                words.storage_offset() + group.offset // width)


def _groups(tensors: list[torch.Tensor], layout: BlockLayout) -> list[CopyGroup]:
    """A group for each stacked tensor whose layers are all in the list, in order, at a
    constant stride in the slot (the kinds of a layer interleave there); then every other
    tensor alone."""
    by_base: dict[int, list[int]] = {}  # id of a stacked tensor -> positions of its layers
    for position, tensor in enumerate(tensors):
        base = tensor._base
        if base is not None and base.is_contiguous() and base.dim() == tensor.dim() + 1:
            by_base.setdefault(id(base), []).append(position)
    groups: list[CopyGroup] = []
    grouped: set[int] = set()
    for positions in by_base.values():
        base = tensors[positions[0]]._base
        assert base is not None
        offsets = [layout.offsets[position] for position in positions]
        stride = offsets[1] - offsets[0] if len(offsets) > 1 else 0
        if len(positions) == base.shape[0] and all(
                _is_layer(tensors[position], base, layer) and offset == offsets[0] + layer * stride
                for layer, (position, offset) in enumerate(zip(positions, offsets, strict=True))):
            groups.append(CopyGroup(_bytes(base), offsets[0], stride, positions[0]))
            grouped.update(positions)
    for position, tensor in enumerate(tensors):
        if position in grouped:
            continue
        if not tensor.is_contiguous():
            raise ValueError(f"cache tensor {position} of shape {tuple(tensor.shape)} is not "
                             "contiguous: its blocks cannot be copied as bytes")
        groups.append(CopyGroup(_bytes(tensor.unsqueeze(0)), layout.offsets[position], 0,
                                position))
    return groups


def _is_layer(tensor: torch.Tensor, base: torch.Tensor, layer: int) -> bool:
    """Whether ``tensor`` (a view of ``base``) is ``base[layer]``."""
    return (tensor.shape == base.shape[1:]
            and tensor.stride() == base.stride()[1:]
            and tensor.data_ptr() == base.data_ptr() + layer * base.stride(0)
            * base.element_size())


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous (layers, blocks, ...) tensor as (layers, blocks, bytes of a block)."""
    return tensor.view(tensor.shape[0], tensor.shape[1], -1).view(torch.uint8)
