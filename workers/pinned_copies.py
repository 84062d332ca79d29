"""Loads from the host tier's pinned slots that read the slots in place, layer by layer under
the step that reads them.

A sequence admitted in the step that loads its prefix (router/tier_loads.py) used to wait for
every layer's blocks before its first layer ran. Here the step's loads go together, a few
layers at a time (``LAYER_CHUNKS`` chunks), each chunk followed by an event; the model waits
before each layer only for the chunk that holds it (workers/layer_gate.py), so chunk i + 1
lands while the layers of chunk i compute.

The copies read the pinned host slots in place: a kernel reads a layer's share of each slot (at
a fixed offset in the slot, workers/host_layout.py) through its unified address and writes it
into the layer's block, one launch a kind of cache tensor a chunk: no staging buffer, no copy
a run of slots. (Stores stay staged: written in place they cost a small model's step more,
docs/experiments.md.) Whether the device reads pinned memory that way is checked once, at
start-up (``KVOffloader``'s probe): where it can't, loads keep the staged whole-block path.

Cache tensors that are not one of the model's per-layer stacks (a draft model's, an EAGLE
head's) are copied in the first chunk, which the step waits for before its forward, as before.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.block_copies import WORDS, BlockCopies

LAYER_CHUNKS = 8  # events a step's loads: more overlap, more launches
MAX_BLOCK_WORDS = 1024
# programs a launch, over its layers: enough bytes in flight for the bus, few enough SMs that
# the step beside the copies keeps the rest. H100, 512 scattered blocks beside a forward-sized
# compute (tools/profile/tier_copies.py): 64 hid the most (0.5B shape 9.25 ms against 9.66 at
# 32, 8B shape 24.55 against 31.95; staged 10.98 / 27.70)
COPY_PROGRAMS = 64


@triton.jit
def _slot_block_kernel(
    host_ptr,  # (slots, slot_words) words of pinned host memory, read in place
    cache_ptr,  # (layers, num_blocks, LAYER_WORDS) words: one kind of cache tensor
    slot_ptr,  # (pairs,) int64 host slots
    block_ptr,  # (pairs,) int64 device blocks
    num_items,  # pairs x CHUNKS
    first_layer,
    slot_words,  # words of a slot
    group_offset,  # where layer 0's share of this kind starts in a slot, in words
    layer_stride,  # words from one layer's share to the next in a slot
    cache_layer_words,  # words of one layer's cache of this kind
    LAYER_WORDS: tl.constexpr,  # words of one layer's share of a block
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,  # BLOCKs of a layer's share
    PROGRAMS: tl.constexpr,  # along axis 0: each program takes every PROGRAMS-th item
):
    """Items of BLOCK words of one (slot, block) pair's share of one layer (axis 1)."""
    layer = (first_layer + tl.program_id(1)).to(tl.int64)
    for item in range(tl.program_id(0), num_items, PROGRAMS):
        pair = item // CHUNKS
        col = (item % CHUNKS) * BLOCK + tl.arange(0, BLOCK)
        mask = col < LAYER_WORDS
        slot = tl.load(slot_ptr + pair).to(tl.int64)
        block = tl.load(block_ptr + pair).to(tl.int64)
        source = host_ptr + slot * slot_words + group_offset + layer * layer_stride + col
        target = cache_ptr + layer * cache_layer_words + block * LAYER_WORDS + col
        tl.store(target, tl.load(source, mask=mask), mask=mask)


@dataclass(frozen=True)
class _Kind:
    """A kind of cache tensor as the kernel sees it: words, not bytes."""

    cache: torch.Tensor  # (layers, num_blocks, layer_words)
    offset: int
    stride: int
    per_layer: bool  # one of the model's per-layer stacks: copied chunk by chunk


class PinnedCopies:
    """Host slots into device blocks, a range of the model's layers at a time."""

    def __init__(self, host: torch.Tensor, copies: BlockCopies, num_layers: int,
                 model_tensors: int, programs: int = COPY_PROGRAMS) -> None:
        width = copies.width
        self.host = host.view(WORDS[width])
        self.slot_words = copies.block_bytes // width
        self.num_layers = num_layers
        self.programs = programs
        self.kinds = [_Kind(words, group.offset // width, group.stride // width,
                            group.first_position < model_tensors
                            and group.cache.shape[0] == num_layers)
                      for group, words in zip(copies.groups, copies.words, strict=True)]

    def chunks(self, num_chunks: int = LAYER_CHUNKS) -> list[tuple[int, int]]:
        """[first, last) layers of each chunk, in order, every layer in one."""
        n = max(1, min(num_chunks, self.num_layers))
        bounds = [round(i * self.num_layers / n) for i in range(n + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def load(self, slots: torch.Tensor, blocks: torch.Tensor, first: int, last: int) -> None:
        """Slots ``slots[i]`` into blocks ``blocks[i]`` (int64, on the cache's device) for
        layers [first, last) of the model's stacks; the first chunk (``first == 0``) also
        copies every other cache tensor whole."""
        for kind in self.kinds:
            if kind.per_layer:
                self._launch(kind, slots, blocks, first, last)
            elif first == 0:
                self._launch(kind, slots, blocks, 0, kind.cache.shape[0])

    def _launch(self, kind: _Kind, slots: torch.Tensor, blocks: torch.Tensor, first: int,
                last: int) -> None:
        _, num_blocks, layer_words = kind.cache.shape
        block = min(MAX_BLOCK_WORDS, triton.next_power_of_2(layer_words))
        chunks = -(-layer_words // block)
        items = len(slots) * chunks
        per_layer = max(1, self.programs // (last - first))
        _slot_block_kernel[(min(items, per_layer), last - first)](
            self.host, kind.cache, slots, blocks, items, first, self.slot_words, kind.offset,
            kind.stride, num_blocks * layer_words,
            LAYER_WORDS=layer_words, BLOCK=block, CHUNKS=chunks, PROGRAMS=per_layer,
        )  # fmt: skip
