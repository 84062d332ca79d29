"""The host tier's bookkeeping: which block hash sits in which slot of the workers' host buffer.

Each shard has a host buffer of ``num_slots`` block-sized slots (pinned memory on a GPU
machine); every shard keeps the same block in the same slot, so this one index, in the engine,
drives them all through the step message. Every slot is in exactly one state::

    free        in ``free_slots``
    evictable   holds a block, unpinned: in the LRU order
    pinned      holds a block being loaded from it (or read into it from disk)

free + evictable + pinned == num_slots. A block evicted from here is handed back to the caller,
who sends it on to the disk tier before its slot is written again.

Every block entering or leaving the index is also an event of the host tier (``take_events``):
the engine sends them with its device cache's, so the KV directory knows which replica can load
or export a block that its device cache no longer holds.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block_hash import BlockHash
from kvstore.events import HOST, BlockRemoved, BlockStored, KVEvent
from kvstore.tier_index import TierIndex


@dataclass(frozen=True)
class HostBlock:
    slot: int
    # the tokens the hash was computed from: a hit is verified against them, as on the GPU
    token_ids: tuple[int, ...]


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.index: TierIndex[HostBlock] = TierIndex(num_slots)
        self.free_slots = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is taken first
        self.events: list[KVEvent] = []  # since the last take_events, in order

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> HostBlock | None:
        block = self.index.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None  # a hash collision must never reuse another prefix's KV
        return block

    def allocate(self, block_hash: BlockHash, token_ids: Sequence[int], pinned: bool = False
                 ) -> tuple[int, tuple[BlockHash, HostBlock] | None] | None:
        """A slot for a new block: a free one, else the least recently used evictable block's,
        which is returned too (the caller demotes it to disk). None when every slot is pinned.
        """
        evicted = None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            evicted = self.index.pop_lru()
            if evicted is None:
                return None
            slot = evicted[1].slot
            self.events.append(BlockRemoved(evicted[0], HOST))
        self.index.add(block_hash, HostBlock(slot, tuple(token_ids)), pinned=pinned)
        self.events.append(BlockStored(block_hash, None, HOST))
        return slot, evicted

    def touch(self, block_hash: BlockHash) -> None:
        self.index.touch(block_hash)

    def pin(self, block_hash: BlockHash) -> None:
        self.index.pin(block_hash)

    def unpin(self, block_hash: BlockHash) -> None:
        self.index.unpin(block_hash)

    def discard(self, block_hash: BlockHash) -> None:
        """Forgets a block whose slot cannot be trusted (its read from disk failed)."""
        if block_hash in self.index:
            self.free_slots.append(self.index.remove(block_hash).slot)
            self.events.append(BlockRemoved(block_hash, HOST))

    def hashes(self) -> tuple[BlockHash, ...]:
        """Every block hash the tier holds (pinned ones too)."""
        return tuple(self.index.entries)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def check_integrity(self) -> None:
        self.index.check_integrity()
        used = [block.slot for block in (e.value for e in self.index.entries.values())]
        assert len(set(used)) == len(used), "two blocks share a host slot"
        assert len(set(self.free_slots)) == len(self.free_slots), "a free slot is listed twice"
        assert not set(used) & set(self.free_slots), "a used slot is also free"
        assert len(used) + len(self.free_slots) == self.num_slots, (
            f"{len(self.free_slots)} free + {len(used)} used != {self.num_slots} host slots"
        )
        assert all(0 <= slot < self.num_slots for slot in [*used, *self.free_slots])
