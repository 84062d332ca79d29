"""Per-request view of the block pool: prefix matching, slot allocation, caching, freeing.

A request's KV lives in a list of blocks; token t sits in row ``t % block_size`` of block
``t // block_size``. The manager only counts tokens and blocks; it never sees tensors::

    tokens:  [ computed (cached or done) | new, this step | lookahead ]
    blocks:  [ ...    enough blocks to hold all three ranges      ... ]

``allocate_slots`` returns ``None`` when the pool is short. That is mechanism, not policy: the
scheduler then decides whom to preempt.

With offload tiers (``tiers.py``) the prefix match goes on below the device pool: blocks found
in the host tier or on disk are loaded into freshly allocated device blocks while the request
waits (``start_load``), and join the prefix cache when they arrive (``finish_load``).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block_hash import BlockHash, ExtraKeys, hash_full_blocks
from kvstore.block_pool import BlockPool, KVBlock
from kvstore.events import KVEvent
from kvstore.tiers import LoadResult, OffloadHits, TierManager
from kvstore.transfers import KVTransfers, TransferReport


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which were found cached, in any tier
    host_hits: int = 0  # of those, found in the host tier
    disk_hits: int = 0  # and on disk

    def record(self, num_queried: int, num_hit: int, num_host: int = 0,
               num_disk: int = 0) -> None:
        self.queries += num_queried
        self.hits += num_hit
        self.host_hits += num_host
        self.disk_hits += num_disk


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_keys: ExtraKeys = (),
        tiers: TierManager | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_keys = extra_keys
        self.pool = BlockPool(num_blocks)
        self.tiers = tiers if enable_prefix_caching else None  # tiers find blocks by hash
        self.stats = PrefixCacheStats()
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_salt: dict[str, ExtraKeys] = {}
        # leading blocks of each request already registered in the cache: caching resumes
        # there, so a decode step that fills no block costs O(1)
        self.req_num_cached: dict[str, int] = {}
        self.req_load_first: dict[str, int] = {}  # a load's first block, while it is under way

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
                if self.tiers is not None and block.block_hash == hashes[index]:
                    self.tiers.on_cached(block, request_id)  # write-through
        self.req_num_cached[request_id] = num_full

    def uncached_hashes(self, request_id: str) -> list[BlockHash]:
        """Hashes of the request's known full blocks that it has not cached yet."""
        return self.req_hashes.get(request_id, [])[self.req_num_cached.get(request_id, 0) :]

    # -- the tiers below the device pool ------------------------------------------------------

    def find_offloaded(self, request_id: str, token_ids: Sequence[int],
                       num_device_hits: int) -> OffloadHits | None:
        """The blocks after the device hits (``get_computed_blocks``, just called) that the
        host tier or disk holds, contiguously; None when there are none."""
        if self.tiers is None:
            return None
        max_blocks = (len(token_ids) - 1) // self.block_size  # the last token is computed
        hashes = self.req_hashes.get(request_id, [])
        hits = self.tiers.find(hashes, token_ids, num_device_hits, max_blocks)
        return hits if hits.num_blocks else None

    def start_load(self, request_id: str, token_ids: Sequence[int], hits: OffloadHits,
                   in_step: bool = False) -> int:
        """Plans the load of ``hits`` into the request's blocks from ``hits.first`` on
        (``allocate_slots`` made them); returns how many blocks it loads. ``in_step``: the
        request runs in the step that carries the load (BlockLoad.in_step)."""
        assert self.tiers is not None
        stop = hits.first + hits.num_blocks
        size = self.block_size
        blocks = self.req_blocks[request_id][hits.first:stop]
        self.req_load_first[request_id] = hits.first
        return self.tiers.start_load(
            request_id, self.req_hashes[request_id][hits.first:stop],
            [token_ids[i * size:(i + 1) * size] for i in range(hits.first, stop)], hits.tiers,
            [block.block_id for block in blocks], in_step)

    def finish_load(self, request_id: str, token_ids: Sequence[int], num_loaded: int) -> int:
        """The load arrived with its first ``num_loaded`` blocks intact: those and the device
        hits before them join the prefix cache. Returns how many tokens they cover."""
        num_tokens = (self.req_load_first.pop(request_id) + num_loaded) * self.block_size
        self.cache_blocks(request_id, token_ids, num_tokens)
        return num_tokens

    def end_load_in_step(self, request_id: str) -> None:
        """A load whose request ran in its step landed: its blocks are cached as the step's
        computed tokens are (``cache_blocks``); only the load's mark goes."""
        self.req_load_first.pop(request_id, None)

    def apply_transfers(self, report: TransferReport) -> dict[str, LoadResult]:
        """The workers' report; the loads it finishes, by request id."""
        return {} if self.tiers is None else self.tiers.apply(report)

    def loading_hashes(self) -> set[BlockHash]:
        return set() if self.tiers is None else self.tiers.loading_hashes()

    def take_transfers(self) -> KVTransfers | None:
        """The copies between tiers the next step message carries."""
        return None if self.tiers is None else self.tiers.take(self.pool)

    def num_cached_blocks(self, request_id: str) -> int:
        """The request's leading blocks registered in the prefix cache."""
        return self.req_num_cached.get(request_id, 0)

    def num_missing_from_host(self, request_id: str) -> int:
        """Of those, the blocks a swap-out would copy: neither in the host tier nor on their
        way there."""
        if self.tiers is None:
            return 0
        tiers = self.tiers
        blocks = self.req_blocks.get(request_id, [])[:self.num_cached_blocks(request_id)]
        return sum(1 for b in blocks if b.block_hash is not None
                   and b.block_hash not in tiers.host and b.block_hash not in tiers.pending)

    def swap_out(self, request_id: str) -> None:
        """A preempted request's cached blocks go to the host tier (most are there already)."""
        if self.tiers is not None:
            self.tiers.swap_out(self.req_blocks.get(request_id, []))

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first; a no-op for unknown requests."""
        if self.tiers is not None:
            self.tiers.cancel_load(request_id)
        blocks = self.req_blocks.pop(request_id, [])
        self.pool.free(reversed(blocks))
        self.req_hashes.pop(request_id, None)
        self.req_salt.pop(request_id, None)
        self.req_num_cached.pop(request_id, None)
        self.req_load_first.pop(request_id, None)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        """The device cache's events since the last call, then the host tier's: each tier's
        in its order (the directory keeps the tiers apart, so their interleaving is moot)."""
        events = self.pool.take_events()
        if self.tiers is not None:
            events.extend(self.tiers.host.take_events())
        return events

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash the prefix cache holds (in use or evictable)."""
        return tuple(self.pool.cached)

    def host_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash the host tier holds; none without one."""
        return () if self.tiers is None else self.tiers.host.hashes()

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
        if self.tiers is not None:
            self.tiers.check_integrity()
        references: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for block in blocks:
                references[block.block_id] = references.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            held = references.get(block.block_id, 0)
            assert block.ref_count == held, (
                f"block {block.block_id}: ref_count {block.ref_count}, held by requests {held}"
            )
