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
"""

from dataclasses import dataclass

import torch

from workers.host_layout import BlockLayout


@dataclass(frozen=True)
class CopyGroup:
    cache: torch.Tensor  # (layers, num_blocks, bytes of one layer's block), uint8, contiguous
    offset: int  # where the first layer's share of a block starts in a slot
    stride: int  # bytes from one layer's share to the next one's in a slot
    first_position: int  # its first tensor's position in the list the layout was made of


class BlockCopies:
    def __init__(self, tensors: list[torch.Tensor], layout: BlockLayout) -> None:
        self.block_bytes = layout.block_bytes
        self.groups = _groups(tensors, layout)

    def gather(self, block_index: torch.Tensor, rows: torch.Tensor) -> None:
        """The blocks ``block_index`` (on the cache's device) into ``rows`` (the first
        ``len(block_index)`` rows of a contiguous uint8 staging buffer), one kernel a group."""
        for group in self.groups:
            torch.index_select(group.cache, 1, block_index, out=self._view(group, rows))

    def scatter(self, block_index: torch.Tensor, rows: torch.Tensor) -> None:
        """``rows`` into the blocks ``block_index``: ``gather``'s inverse."""
        for group in self.groups:
            group.cache.index_copy_(1, block_index, self._view(group, rows))

    def _view(self, group: CopyGroup, rows: torch.Tensor) -> torch.Tensor:
        """The group's bytes of ``rows`` as (layers, rows, bytes of a layer's block)."""
        layers, _, size = group.cache.shape
        return rows.as_strided((layers, rows.shape[0], size), (group.stride, self.block_bytes, 1),
                               rows.storage_offset() + group.offset)


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
