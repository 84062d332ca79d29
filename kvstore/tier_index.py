"""Which blocks one offload tier holds: an LRU order, pins, and a capacity in blocks.

Every entry is in exactly one of two states::

    evictable   pins == 0   in the LRU order, least recently used first
    pinned      pins  > 0   out of the LRU order: a copy in or out of it is under way

Eviction takes the least recently used evictable entry; a pinned one is never evicted, so a
block being loaded cannot vanish under its load. The host and disk tiers both keep one.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstore.block_hash import BlockHash

V = TypeVar("V")


@dataclass
class TierEntry(Generic[V]):
    value: V
    pins: int = 0


class TierIndex(Generic[V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"a tier's capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self.entries: dict[BlockHash, TierEntry[V]] = {}
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()  # evictable, oldest first

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    @property
    def num_pinned(self) -> int:
        return len(self.entries) - len(self.lru)

    @property
    def is_full(self) -> bool:
        return len(self.entries) >= self.capacity

    def get(self, block_hash: BlockHash) -> V | None:
        entry = self.entries.get(block_hash)
        return None if entry is None else entry.value

    def touch(self, block_hash: BlockHash) -> None:
        """Marks an entry the most recently used (a pinned one moves when it is unpinned)."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)

    def add(self, block_hash: BlockHash, value: V, pinned: bool = False) -> None:
        """A new entry, the most recently used; the caller has made room (``pop_lru``)."""
        if block_hash in self.entries:
            raise KeyError(f"block {block_hash.hex()[:16]} is already in the tier")
        if self.is_full:
            raise RuntimeError(f"the tier is full ({self.capacity} blocks)")
        self.entries[block_hash] = TierEntry(value, pins=int(pinned))
        if not pinned:
            self.lru[block_hash] = None

    def pop_lru(self) -> tuple[BlockHash, V] | None:
        """Evicts the least recently used evictable entry; None when every entry is pinned."""
        if not self.lru:
            return None
        block_hash, _ = self.lru.popitem(last=False)
        return block_hash, self.entries.pop(block_hash).value

    def pin(self, block_hash: BlockHash) -> None:
        entry = self.entries[block_hash]
        if entry.pins == 0:
            del self.lru[block_hash]
        entry.pins += 1

    def unpin(self, block_hash: BlockHash) -> None:
        """Drops one pin; an entry left with none becomes the most recently used."""
        entry = self.entries[block_hash]
        if entry.pins <= 0:
            raise RuntimeError(f"block {block_hash.hex()[:16]} unpinned more often than pinned")
        entry.pins -= 1
        if entry.pins == 0:
            self.lru[block_hash] = None

    def remove(self, block_hash: BlockHash) -> V:
        """Takes an entry out whatever its pins (its copy failed: nothing may find it)."""
        entry = self.entries.pop(block_hash)
        self.lru.pop(block_hash, None)
        return entry.value

    def check_integrity(self) -> None:
        """Conservation: evictable + pinned == entries <= capacity, each in its one place."""
        pinned = [h for h, e in self.entries.items() if e.pins > 0]
        assert all(e.pins >= 0 for e in self.entries.values()), "an entry has negative pins"
        assert len(self.lru) + len(pinned) == len(self.entries), (
            f"{len(self.lru)} evictable + {len(pinned)} pinned != {len(self.entries)} entries"
        )
        assert all(h in self.entries and self.entries[h].pins == 0 for h in self.lru), (
            "the LRU order holds a pinned or unknown entry"
        )
        assert len(self.entries) <= self.capacity, (
            f"{len(self.entries)} entries in a tier of {self.capacity}"
        )
