"""Per-request view of the block pool: prefix matching, slot allocation, caching, freeing.

A request's KV lives in a list of blocks; token t sits in row ``t % block_size`` of block
``t // block_size``. The manager only counts tokens and blocks; it never sees tensors::

    tokens:  [ computed (cached or done) | new, this step | lookahead ]
    blocks:  [ ...    enough blocks to hold all three ranges      ... ]

``allocate_slots`` returns ``None`` when the pool is short. That is mechanism, not policy: the
scheduler then decides whom to preempt.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block_hash import BlockHash, ExtraKeys, hash_full_blocks
from kvstore.block_pool import BlockPool, KVBlock
from kvstore.events import KVEvent


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which were found cached

    def record(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_keys: ExtraKeys = (),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_keys = extra_keys
        self.pool = BlockPool(num_blocks)
        self.stats = PrefixCacheStats()
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_salt: dict[str, ExtraKeys] = {}
        # leading blocks of each request already registered in the cache: caching resumes
        # there, so a decode step that fills no block costs O(1)
        self.req_num_cached: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def num_blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """How many more blocks the request needs to hold ``num_tokens`` tokens."""
        num_held = len(self.req_blocks.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_blocks.get(request_id, [])]

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of full blocks, and how many tokens it covers.

        At most ``len(token_ids) - 1`` tokens count as computed: the last token must run
        through the model so that its logits can be sampled. The caller records the lookup in
        ``stats`` once the request is admitted, so a request that waits is counted once.
        """
        self.req_salt[request_id] = self.extra_keys + ((cache_salt,) if cache_salt else ())
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._hashes(request_id, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[KVBlock] = []
        for index, block_hash in enumerate(hashes[:max_blocks]):
            start = index * self.block_size
            block = self.pool.lookup(block_hash, token_ids[start : start + self.block_size])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) after the computed tokens.

        ``num_computed_tokens`` includes the tokens of ``new_computed_blocks`` (prefix hits
        found by ``get_computed_blocks`` this step). Returns the newly allocated blocks, or
        ``None`` — changing nothing — when the pool cannot supply them.
        """
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_blocks[request_id] = []
        num_tokens = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_needed = -(-num_tokens // self.block_size) - len(blocks) - len(new_computed_blocks)
        if num_needed <= 0 and not new_computed_blocks:
            return []  # the common decode step: the last block still has room
        # hits that sit evictable in the free queue leave it when touched
        num_reclaimed = sum(1 for block in new_computed_blocks if block.ref_count == 0)
        if max(num_needed, 0) + num_reclaimed > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request_id]
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0)) or []
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Register the full blocks among the first ``num_computed_tokens`` (verified) tokens."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        first = self.req_num_cached.get(request_id, 0)
        if num_full <= first:
            return  # no block filled since the last call
        hashes = self._hashes(request_id, token_ids, num_full)
        for index in range(first, num_full):
            block = blocks[index]
            if block.block_hash is None:
                start = index * self.block_size
                parent = hashes[index - 1] if index else None
                tokens = token_ids[start : start + self.block_size]
                self.pool.cache(block, hashes[index], parent, tokens)
        self.req_num_cached[request_id] = num_full

    def uncached_hashes(self, request_id: str) -> list[BlockHash]:
        """Hashes of the request's known full blocks that it has not cached yet."""
        return self.req_hashes.get(request_id, [])[self.req_num_cached.get(request_id, 0) :]

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first; a no-op for unknown requests."""
        blocks = self.req_blocks.pop(request_id, [])
        self.pool.free(reversed(blocks))
        self.req_hashes.pop(request_id, None)
        self.req_salt.pop(request_id, None)
        self.req_num_cached.pop(request_id, None)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash the prefix cache holds (in use or evictable)."""
        return tuple(self.pool.cached)

    def _hashes(self, request_id: str, token_ids: Sequence[int],
                num_full: int | None = None) -> list[BlockHash]:
        """Hashes of the first ``num_full`` full blocks of token_ids (all of them by default),
        extending those already computed for the request."""
        known = self.req_hashes.get(request_id, [])
        if num_full is None:
            num_full = len(token_ids) // self.block_size
        if len(known) < num_full:
            salt = self.req_salt.get(request_id, self.extra_keys)
            known = hash_full_blocks(token_ids, self.block_size, salt, known, num_full)
            self.req_hashes[request_id] = known
        return known[:num_full]

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        references: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for block in blocks:
                references[block.block_id] = references.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            held = references.get(block.block_id, 0)
            assert block.ref_count == held, (
                f"block {block.block_id}: ref_count {block.ref_count}, held by requests {held}"
            )
