"""The pool of KV blocks: reference counts, the free queue and the prefix cache.

Every block is in exactly one of three states::

    free        ref_count == 0, no hash      in the free queue
    evictable   ref_count == 0, has a hash   in the free queue, and findable by its hash
    in use      ref_count  > 0               not in the free queue

The free queue's order is the eviction order: allocation takes from its front, a freed block
goes to its back. A freed block keeps its hash until it is handed out again, so the free queue
doubles as the LRU cache of finished prefixes.
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.block_hash import BlockHash
from kvstore.events import BlockRemoved, BlockStored, KVEvent


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # the tokens the hash was computed from: a hit is verified against them
    token_ids: tuple[int, ...] = field(default=(), repr=False)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events: list[KVEvent] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus evictable."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None  # a hash collision must never reuse another prefix's KV
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cached blocks, pulling evictable ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        if num_blocks > len(self.free_queue):
            return None
        allocated = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of the queue.

        Callers pass a sequence's blocks tail first, so its tail (the least shared part of a
        prefix) is evicted before its head.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def cache(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
    ) -> None:
        """Make a full, computed block findable by its hash (once per hash)."""
        if block.block_hash is not None or block_hash in self.cached:
            return  # another block already holds this prefix: keep that one
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        self.events.append(BlockStored(block_hash, parent_hash))

    def reset_prefix_cache(self) -> int:
        """Forget every evictable block's hash; returns how many were forgotten."""
        evictable = [block for block in self.free_queue.values() if block.block_hash]
        for block in evictable:
            self._evict(block)
        return len(evictable)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        self.events.append(BlockRemoved(block.block_hash))
        block.block_hash = None
        block.token_ids = ()

    def check_integrity(self) -> None:
        """Conservation: free + evictable + in use == total, and each index is consistent."""
        in_use = [block for block in self.blocks if block.ref_count > 0]
        queued = self.free_queue.values()
        assert all(block.ref_count == 0 for block in queued), "a queued block is referenced"
        assert len(in_use) + len(self.free_queue) == self.num_blocks, (
            f"{len(in_use)} in use + {len(self.free_queue)} free != {self.num_blocks} blocks"
        )
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"block {block.block_id} has a stale hash"
        hashed = sum(1 for block in self.blocks if block.block_hash is not None)
        assert hashed == len(self.cached), "a hashed block is missing from the cache index"
