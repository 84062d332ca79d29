"""The sequences waiting for their prefix's blocks to come back from disk, and those loading
from the host tier in the step that runs them (``start_in_step``: nothing waits).

A waiting sequence whose prefix goes on past the device's prefix cache into block files
leaves the queue while those blocks are copied into fresh device blocks (``start``); the
scheduler runs the others meanwhile and puts it back at the head of the queue when the workers
report the blocks landed (``landed``), or when the load is given up: not back within
``timeout_s`` (``expired``), or back with no block intact. A sequence whose load was given up
loads no more; it recomputes. A load is started only where it is cheaper than recomputing the
same tokens (kv_pricing.py), at the rates the engine measures as it runs, behind the loads
queued before it (live_rates.py). Those rates are measured on the loads themselves, so of the
loads priced out, every ``PROBE_EVERY``-th is started anyway: where loads got cheaper again
(the steps lighter, the bus free), the price follows.

The same rates decide the write-through (``price_write_through``): blocks entering the device
cache are copied to the host tier only while storing one and loading it back cost at most half
of recomputing its tokens (kv_pricing.store_pays). Where they cost more (a small model, whose
prefill is about as cheap as the host's and the copies' work per block), writing them through
would mostly slow the steps that carry it.
"""

from collections.abc import Callable
from dataclasses import replace

from kvstore.block_pool import KVBlock
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.tiers import LoadResult, OffloadHits
from kvstore.transfers import TransferReport
from router.kv_pricing import load_pays, store_pays
from router.live_rates import LiveRates
from router.sequence import Sequence

PROBE_EVERY = 16  # of the loads the price turns down, this one in so many is started anyway


class TierLoads:
    def __init__(self, kv: KVCacheManager, rates: LiveRates | None,
                 clock: Callable[[], float], timeout_s: float) -> None:
        self.kv = kv
        self.rates = rates
        self.clock = clock
        self.timeout_s = timeout_s
        self.loading: dict[str, Sequence] = {}
        self.started: dict[str, float] = {}  # by the clock, for the timeout
        self.recomputes: set[str] = set()  # a load of theirs was given up: no more loads
        # tokens a sequence's loads brought from the host tier and disk, counted as prefix
        # hits of those tiers when it is admitted
        self.loaded_tokens: dict[str, tuple[int, int]] = {}
        # sequences admitted in the step that loads their prefix from the host tier, until
        # the workers report the load (``start_in_step``)
        self.in_step: set[str] = set()
        self.num_priced_out = 0  # loads the price turned down, since start-up

    def price_write_through(self) -> None:
        """Turns the write-through on or off by the current rates (kvstore/tiers.py), a
        block's store costing the workers' copy out and the host's time to plan it."""
        tiers = self.kv.tiers
        if tiers is None:
            return
        rates = self.rates.current() if self.rates is not None else None
        if rates is not None and rates.store_seconds_per_block:
            # (a store probed at start-up: on a GPU. On the CPU stores are not priced, so
            # that the tests' write-through does not depend on the machine's speed)
            rates = replace(rates, store_seconds_per_block=rates.store_seconds_per_block
                            + tiers.counters.plan_seconds_per_block())
        tiers.write_through = store_pays(rates, self.kv.block_size)

    def find(self, seq: Sequence, num_hits: int) -> OffloadHits | None:
        """The blocks to load from below the pool, after ``num_hits`` device hits: none where
        loading them costs more than computing them, or after a load of it was given up."""
        if seq.request_id in self.recomputes:
            return None
        below = self.kv.find_offloaded(seq.request_id, seq.token_ids, num_hits)
        if below is None:
            return None
        rates, queued = (self.rates.current(), self.rates.queued_blocks) if self.rates else (
            None, 0)
        if not load_pays(rates, below.num_blocks, below.num_blocks * self.kv.block_size, queued):
            self.num_priced_out += 1
            if self.num_priced_out % PROBE_EVERY:
                return None  # recomputed; the next probe measures loads again
        return below

    def start(self, seq: Sequence, hits: list[KVBlock], num_cached: int,
              below: OffloadHits) -> int | None:
        """Device blocks for the prefix found below the pool, and their load; how many blocks
        it loads (0: none after all, its blocks are freed again), None when they do not fit."""
        num_tokens = below.num_blocks * self.kv.block_size
        if self.kv.allocate_slots(seq.request_id, num_cached, num_tokens, hits) is None:
            return None
        count = self.kv.start_load(seq.request_id, seq.token_ids, below)
        if count:
            self.loading[seq.request_id] = seq
            self.started[seq.request_id] = self.clock()
            if self.rates is not None:
                self.rates.load_started(seq.request_id, count)
        else:
            self.kv.free(seq.request_id)
        return count

    def start_in_step(self, seq: Sequence, below: OffloadHits) -> None:
        """Loads a prefix found in the host tier alone into the sequence's blocks
        (``allocate_slots`` made them) in the step that runs it: the workers issue the copies
        before the forward, which waits for them on the device (workers/kv_offload.py)."""
        count = self.kv.start_load(seq.request_id, seq.token_ids, below, in_step=True)
        assert count == below.num_blocks, "a host-tier block needs no slot to load"
        self.in_step.add(seq.request_id)
        if self.rates is not None:
            self.rates.load_started(seq.request_id, count)

    def expired(self) -> list[Sequence]:
        """The sequences whose loads passed the timeout, given up (their blocks freed and
        unpinned; the copies may still land: the workers order them before any later use of
        those blocks), oldest first."""
        deadline = self.clock() - self.timeout_s
        given_up = []
        for request_id in [r for r, t in self.started.items() if t <= deadline]:
            del self.started[request_id]
            seq = self.loading.pop(request_id)
            self._ended(request_id)
            self.kv.free(request_id)
            self.recomputes.add(request_id)
            given_up.append(seq)
        return given_up

    def landed(self, report: TransferReport) -> tuple[dict[str, LoadResult], list[Sequence]]:
        """The workers' report: each sequence whose load landed has its blocks cached (those
        that arrived intact) and freed, to find them as prefix hits. Returns the finished
        loads' results, and those sequences."""
        results = self.kv.apply_transfers(report)
        back = []
        for request_id, num_loaded in report.loaded.items():
            if request_id in self.in_step:  # it ran in the load's step: nothing waits
                self.in_step.discard(request_id)
                self._ended(request_id)
                self.kv.end_load_in_step(request_id)
                continue
            seq = self.loading.pop(request_id, None)
            if seq is None:
                continue  # aborted or given up while it loaded
            self._ended(request_id)
            self.started.pop(request_id, None)
            if num_loaded == 0:  # the copy failed: its blocks would fail again
                self.recomputes.add(request_id)
            self.kv.finish_load(request_id, seq.token_ids, num_loaded)
            self.kv.free(request_id)
            result = results.get(request_id)
            if result is not None:  # a sequence may load twice (the first load was cut short)
                size = self.kv.block_size
                host, disk = self.loaded_tokens.get(request_id, (0, 0))
                self.loaded_tokens[request_id] = (host + result.num_host_blocks * size,
                                                  disk + result.num_disk_blocks * size)
            back.append(seq)
        return results, back

    def forget(self, request_id: str) -> Sequence | None:
        """The request ends: its sequence if it was loading (the caller frees its blocks)."""
        self.started.pop(request_id, None)
        self.recomputes.discard(request_id)
        self.in_step.discard(request_id)
        self._ended(request_id)
        seq = self.loading.pop(request_id, None)
        if seq is None:
            self.loaded_tokens.pop(request_id, None)
        return seq

    def _ended(self, request_id: str) -> None:
        if self.rates is not None:
            self.rates.load_ended(request_id)
