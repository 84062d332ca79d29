"""Continuous batching by token counts.

Each step fills a token budget: running sequences first (oldest first), then waiting ones
(first come, first served). A sequence gets as many of its missing tokens as the budget allows,
so a long prompt is prefilled in chunks mixed with the decodes of other sequences. When the KV
pool is short, the newest running sequence is preempted by recompute: its blocks are freed and
it waits at the head of the queue to be prefilled again (its generated tokens kept). With a
host tier, its blocks are also in host memory (written through as they filled, the few missing
copied at preemption), so it resumes by loading them rather than recomputing: swap preemption,
when the measured copy is cheaper than the recompute (kv_pricing.py); else the missing blocks
are not copied, and a load is started only where it is cheaper than recomputing, too.

A waiting sequence whose prefix goes on past the device's prefix cache into the host tier runs
in the step that loads those blocks (the workers copy them before its forward); one whose
prefix is on disk first loads while the others run (tier_loads.py), its blocks then ordinary
prefix hits.

When every running sequence is decoding and nobody waits, one call to the workers may run
several decode steps back to back (``decode_steps``): the device feeds each step the tokens of
the one before, so the host's per-step work (this scheduler, the step message, reading tokens)
is paid once per call instead of once per token. Stops found inside a call drop the tokens
after them. A sequence whose sampling must see each token before the next (a grammar,
penalties, min_tokens still masking) rides along in such a call and keeps its first token
alone: its row costs the call little, and the other rows keep their several steps (a call of
riders alone runs one step).

Such a call may also ask for one lookahead step (``decode_lookahead``): when some sequence
certainly goes on past the call (it does not reach its ``max_tokens`` in it) and every one has
room in the model's length for one step more, the workers run the first step of the next call
as well, into a slot allocated here, while the host reads this call's tokens and schedules the
next. The next call starts from it if each sequence it schedules is one the lookahead stepped,
at the position it stepped (the rows of sequences that finished meanwhile are dropped: a
large batch has one finishing in nearly every call); else the lookahead is dropped (its K/V
lies in the sequence's own slot and is written again when that position is computed).

With async scheduling the engine schedules a step before the one in flight is read
(``launched``): its tokens count as computed at launch and each row that samples has a token
pending (``Sequence.num_pending``), the input of its next decode, filled in by the workers on
the device; ``update`` commits the tokens a call later.
"""

import time
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvstore.kv_cache_manager import KVCacheManager
from kvstore.tiers import LoadResult
from kvstore.transfers import TransferReport
from router.kv_pricing import TransferRates, swap_pays
from router.live_rates import LiveRates
from router.prefill_delay import PrefillDelay
from router.sequence import FinishReason, Sequence, SequenceStatus
from router.tier_loads import TierLoads
from router.token_budget import TokenBudget


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_prefill_chunk: int = 0  # at most this many tokens of one sequence per step; 0 = budget
    num_lookahead_tokens: int = 0  # extra slots for speculative tokens after a decode
    decode_steps: int = 1  # decode steps one call may run back to back (see the module doc)
    decode_lookahead: bool = False  # multi-step calls also run the next call's first step
    # False: a prompt is prefilled in one step or waits (its uncached tokens fit the budget)
    enable_chunked_prefill: bool = True
    scheduler_delay_factor: float = 0.0  # router/prefill_delay.py
    tpot_target_ms: float = 0.0  # the budget from the measured step cost (token_budget.py)
    kv_load_timeout_s: float = 30.0  # a load from the host tier or disk not back by then: recompute

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.decode_steps < 1:
            raise ValueError("decode_steps must be at least 1")
        if self.kv_load_timeout_s <= 0:
            raise ValueError("kv_load_timeout_s must be > 0")


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    new_block_ids: list[int]
    is_new: bool  # the workers hear of it now: first admission, or again after a preemption
    # speculative tokens verified in this step, the last num_new_tokens' (a decode's 1 + k)
    draft_token_ids: list[int] = field(default_factory=list)
    # or how many a draft model makes in the worker before the verify (also the last ones)
    num_model_drafts: int = 0

    @property
    def num_drafts(self) -> int:
        """Both only in the speculative benchmark: the draft model runs, its drafts set
        aside for the benchmark's own (cluster/bench/speculative.py Oracle)."""
        return len(self.draft_token_ids) or self.num_model_drafts


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # sequences the workers knew that are gone (finished, aborted, preempted): drop their state
    released_ids: list[str] = field(default_factory=list)
    num_steps: int = 1  # > 1: every scheduled sequence decodes this many tokens in one call
    lookahead: bool = False  # and one step more, the next call's first (a slot is allocated)
    launched: bool = False  # its tokens are read a call later (``Scheduler.launched``)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 rates: TransferRates | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``rates``: measured at start-up, they price swaps and loads against recomputes
        (None: always swap and load), moved by what the running engine measures
        (router/live_rates.py)."""
        self.config = config
        self.kv = kv
        self.rates = LiveRates(rates) if rates is not None else None
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._known_to_workers: set[str] = set()
        self._released: list[str] = []
        self.prefill_delay = PrefillDelay(config.scheduler_delay_factor)
        self.token_budget = TokenBudget(config.tpot_target_ms, config.max_num_batched_tokens)
        # waiting for blocks from the host tier or disk
        self.loads = TierLoads(kv, self.rates, clock, config.kv_load_timeout_s)
        self.loading = self.loads.loading  # by request id

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        if self.loading:
            self.waiting.extendleft(reversed(self.loads.expired()))
        self.loads.price_write_through()
        output = SchedulerOutput()
        output.num_steps, output.lookahead = self._num_decode_steps()
        budget = self._schedule_running(output, self.token_budget.budget(len(self.running)))
        oldest = self.waiting[0].arrival_time if self.waiting else None
        admits = self.prefill_delay.admits(oldest, bool(self.running))
        if admits and not output.preempted_ids:  # memory is short: admit nobody new this step
            self._schedule_waiting(output, budget)
        output.released_ids, self._released = self._released, []
        return output

    def _num_decode_steps(self) -> tuple[int, bool]:
        """(steps, lookahead): ``decode_steps`` when every running sequence decodes, none
        samples from its history (penalties), nobody waits and the pool holds every slot ahead;
        otherwise 1. The lookahead step (module doc) when it is on, the call has several steps,
        some sequence outlives the call, every one has room for a step more in the model's
        length and the pool also holds the lookahead's slots.

        A sequence that reaches its ``max_tokens`` inside a call has its later tokens dropped:
        its row costs nothing extra in a batch that runs anyway, where capping the call by the
        nearest end would shrink nearly every call of a large batch. Only steps that nobody
        needs are cut, and no sequence may pass the model's length."""
        steps = self.config.decode_steps
        running = self.running
        if steps == 1 or self.waiting or not running or (
            len(running) > self.config.max_num_batched_tokens
        ):
            return 1, False
        needed = 1  # the most tokens any sequence wants
        least_room = self.config.max_model_len  # the fewest tokens the model's length allows
        riders = 0  # sequences that keep one token of the call (module doc)
        masked = False  # a grammar's row: no lookahead step
        for seq in running:
            masked = masked or seq.masks_each_token
            if seq.num_tokens - seq.num_computed_tokens != 1 or (
                    seq.needs_single_steps and not seq.samples_one_at_a_time):
                return 1, False  # a prefill, or drafts to verify
            if seq.samples_one_at_a_time:
                riders += 1
                continue
            wanted = seq.params.max_tokens - seq.num_output_tokens
            room = self.config.max_model_len - seq.num_tokens
            needed = max(needed, wanted)
            least_room = min(least_room, room)
            steps = min(steps, room)
        if riders == len(running):
            return 1, False
        steps = max(1, min(steps, needed))
        grow, free = self.kv.num_blocks_to_grow, self.kv.num_free_blocks

        def fits(num_slots: int) -> bool:  # every sequence's next num_slots slots
            return sum(grow(s.request_id, s.num_computed_tokens + num_slots)
                       for s in running) <= free

        # someone goes on past the call (steps < needed), everyone has a slot for a step more;
        # not with riders, whose next token is not the call's last, nor a grammar's rows
        looks_ahead = self.config.decode_lookahead and 1 < steps < min(needed, least_room) \
            and not riders and not masked
        if looks_ahead and fits(steps + 1):
            return steps, True
        return (steps, False) if fits(steps) else (1, False)

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        chunk = self.config.max_prefill_chunk
        # the slots of every step of the call after the first (and of the lookahead step), or
        # the speculative ones
        lookahead_len = max(self.config.num_lookahead_tokens,
                            output.num_steps - 1 + output.lookahead)
        allocate, scheduled = self.kv.allocate_slots, output.scheduled
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.num_pending and self._ends_in_flight(seq):
                index += 1  # its last token is in flight: nothing more to compute
                continue
            num_computed = seq.num_computed_tokens
            num_missing = len(seq.token_ids) + seq.num_pending - num_computed
            num_new = min(num_missing, budget, chunk) if chunk else min(num_missing, budget)
            drafts = self._drafts(seq, budget)
            model_drafts = self._model_drafts(seq, budget)
            if drafts and model_drafts:  # the benchmark's (ScheduledSequence.num_drafts)
                model_drafts = len(drafts)
            num_new += len(drafts) or model_drafts
            lookahead = lookahead_len if num_new >= num_missing else 0
            while True:
                blocks = allocate(seq.request_id, num_computed, num_new,
                                  num_lookahead_tokens=lookahead)
                if blocks is not None:
                    break
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                output.preempted_ids.append(victim.request_id)
                if victim is seq:
                    return budget
            new_ids = [b.block_id for b in blocks] if blocks else []
            scheduled.append(ScheduledSequence(seq, num_new, new_ids, False, drafts,
                                               model_drafts))
            budget -= num_new
            index += 1
        return budget

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The proposed tokens a decoding sequence verifies this step: as many as the budget
        has room for beside its own token, and no more than could be kept (its max_tokens and
        the model's length take the bonus token too). Taken: the next step has new ones."""
        drafts = seq.spec_token_ids
        if not drafts:  # nothing proposed (speculation off): no new list per sequence a step
            return drafts
        seq.spec_token_ids = []
        return drafts[: self._draft_room(seq, budget)]

    def _model_drafts(self, seq: Sequence, budget: int) -> int:
        """``_drafts`` for a draft model's: how many it makes this step (taken likewise)."""
        wanted, seq.num_model_drafts = seq.num_model_drafts, 0
        return min(wanted, self._draft_room(seq, budget)) if wanted else 0

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """How many drafts a sequence may verify this step: as many as the budget has room
        for beside its own token, and no more than could be kept (its max_tokens and the
        model's length take the bonus token too); none unless it decodes."""
        if seq.num_tokens - seq.num_computed_tokens != 1:
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens,
                   self.config.max_model_len - seq.num_tokens) - 1
        return max(0, min(room, budget - 1))

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order, skipping (not dequeuing) those that would
        recompute a prefix a running sequence is computing now: they wait for its blocks to be
        cached and then hit them. A skipped sequence keeps its place in the queue."""
        in_flight = self._in_flight_hashes()
        index = 0
        # a loading sequence runs as soon as its blocks land: it holds a place, or the blocks
        # of loads beyond the places would wait on the device, be evicted, and load again
        while index < len(self.waiting) and budget > 0 and (
            len(self.running) + len(self.loading) < self.config.max_num_seqs
        ):
            seq = self.waiting[index]
            hits, num_cached = self.kv.get_computed_blocks(
                seq.request_id, seq.token_ids, seq.params.cache_salt
            )
            if self._waits_for_prefix(seq, len(hits), in_flight):
                index += 1
                continue
            below = self.loads.find(seq, len(hits))
            num_loaded = 0  # tokens of a host-tier prefix loaded in this step, before it runs
            if below is not None and below.host_only:
                num_loaded = below.num_blocks * self.kv.block_size
            elif below is not None:
                loads = self.loads.start(seq, hits, num_cached, below)
                if loads is None:
                    break  # no room for its blocks: memory is short
                if loads:
                    del self.waiting[index]
                    if in_flight is not None:
                        in_flight.update(self.kv.uncached_hashes(seq.request_id))
                    continue
                hits, num_cached = self.kv.get_computed_blocks(  # nothing loadable after all
                    seq.request_id, seq.token_ids, seq.params.cache_salt)
            computed = num_cached + num_loaded
            num_new = self._num_new_tokens(seq, computed, budget)
            if num_new < seq.num_tokens - computed and not self.config.enable_chunked_prefill:
                break  # the whole prompt waits for a step with room for it (first come first)
            lookahead = self._lookahead(seq, computed, num_new)
            blocks = self.kv.allocate_slots(
                seq.request_id, num_cached, num_loaded + num_new, hits,
                num_lookahead_tokens=lookahead
            )
            if blocks is None:
                break
            if num_loaded:
                assert below is not None
                self.loads.start_in_step(seq, below)
                num_cached = computed
            host, disk = self.loads.loaded_tokens.pop(seq.request_id, (0, 0))
            host = min(host + num_loaded, num_cached)  # what a load brought and is still cached
            self.kv.stats.record(seq.num_tokens, num_cached, host, min(disk, num_cached - host))
            del self.waiting[index]
            self._admit(seq, num_cached)
            block_ids = self.kv.block_ids(seq.request_id)
            output.scheduled.append(ScheduledSequence(seq, num_new, block_ids, is_new=True))
            budget -= num_new
            if in_flight is not None:
                in_flight.update(self.kv.uncached_hashes(seq.request_id))

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """A call's time: the step cost the token budget follows (router/token_budget.py). The
        rates loads are priced by come from the workers' timed steps (``apply_transfers``)."""
        if not self.token_budget.target_s:
            return  # off: nothing to count in the step
        tokens = sum(item.num_new_tokens for item in output.scheduled)
        self.token_budget.observe(output.num_steps, tokens, seconds)

    def apply_transfers(self, report: TransferReport) -> dict[str, LoadResult]:
        """The workers' report of KV copies: each sequence whose load landed goes back to the
        head of the queue, where it finds its blocks as prefix hits (tier_loads.py). Returns
        the finished loads' results."""
        if self.rates is not None:
            self.rates.observe_copies(report.copied_bytes, report.copy_seconds)
            for cost in report.steps:
                self.rates.observe_step_cost(cost)
        results, back = self.loads.landed(report)
        self.waiting.extendleft(reversed(back))
        return results

    def _admit(self, seq: Sequence, num_cached: int) -> None:
        seq.num_computed_tokens = num_cached
        if seq.num_cached_tokens < 0:  # first admission
            seq.num_cached_tokens = num_cached
            seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._known_to_workers.add(seq.request_id)

    def _in_flight_hashes(self) -> set[bytes] | None:
        """Hashes of the prompt blocks running sequences are still computing (not yet cached).

        Only sequences still in their prompt count: a decoding one fills a block of generated
        tokens, which another request is unlikely to share. None when caching is off.
        """
        if not self.kv.enable_prefix_caching or not self.waiting:
            return None
        in_flight: set[bytes] = self.kv.loading_hashes() if self.loading else set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                in_flight.update(self.kv.uncached_hashes(seq.request_id))
        return in_flight

    def _waits_for_prefix(self, seq: Sequence, num_hits: int,
                          in_flight: set[bytes] | None) -> bool:
        """Whether the block right after seq's cached prefix is being computed by another.

        No deadlock: the blocks in flight belong to running sequences, which are scheduled
        before any waiting one, so they get cached (or their owner is preempted or finishes,
        which takes them out of the set) within a few steps.
        """
        if not in_flight:
            return False
        hashes = self.kv.req_hashes.get(seq.request_id, [])
        max_blocks = (seq.num_tokens - 1) // self.kv.block_size
        return num_hits < min(len(hashes), max_blocks) and hashes[num_hits] in in_flight

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int) -> int:
        num_new = min(seq.num_tokens - num_computed, budget)
        if self.config.max_prefill_chunk:
            num_new = min(num_new, self.config.max_prefill_chunk)
        return num_new

    def _lookahead(self, seq: Sequence, num_computed: int, num_new: int) -> int:
        reaches_end = num_computed + num_new == seq.num_tokens
        return self.config.num_lookahead_tokens if reaches_end else 0

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Its pending tokens reach its ``max_tokens`` or the model's length."""
        return (seq.num_output_tokens + seq.num_pending >= seq.params.max_tokens
                or seq.num_tokens + seq.num_pending >= self.config.max_model_len)

    def launched(self, output: SchedulerOutput) -> None:
        """The step went to the workers, whose tokens are read one call later (async
        scheduling): its tokens count as computed now, and each row that samples has a token
        pending, so the next step is scheduled before this one is read (``update`` commits it).
        One step a call: a pending token is the input of the next step's decode."""
        assert output.num_steps == 1, "a call of several steps is read when it returns"
        output.launched = True
        for item in output.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens + seq.num_pending:
                seq.num_pending += 1  # caught up: the step samples its next token

    def update(self, output: SchedulerOutput, sampled: Mapping[str, Seq[int]]) -> list[Sequence]:
        """Commit a step: advance counters, append sampled tokens, cache full blocks.

        Returns the sequences that finished in this step (their blocks are already freed).
        """
        if output.launched:
            return self._update_launched(output, sampled)
        finished: list[Sequence] = []
        cache_blocks = self.kv.cache_blocks
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            # a call of k steps computes the first input and the k - 1 tokens fed back after it
            tokens = sampled.get(seq.request_id, ())
            num_computed = item.num_new_tokens + output.num_steps - 1
            if item.num_drafts:  # the drafts' K/V holds up to the first rejected one
                num_computed += len(tokens) - 1 - item.num_drafts
            rides = output.num_steps > 1 and seq.samples_one_at_a_time
            seq.num_computed_tokens += num_computed
            self._append_until_stop(seq, tokens[:1] if rides else tokens)
            # a rider's token is computed again next call, where its sampling sees it
            seq.num_computed_tokens = min(seq.num_computed_tokens,
                                          seq.num_tokens - 1 if rides else seq.num_tokens)
            cache_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens)
            if seq.is_finished:
                self._release(seq)
                finished.append(seq)
        return finished

    def _update_launched(self, output: SchedulerOutput,
                         sampled: Mapping[str, Seq[int]]) -> list[Sequence]:
        """``update`` for a launched step (its counters moved at launch). A sequence
        preempted meanwhile keeps its token too (it is recomputed with it); one finished
        meanwhile drops it, and one that has a later step in flight has its row there wasted
        if this token ends it."""
        finished: list[Sequence] = []
        for item in output.scheduled:
            seq = item.seq
            tokens = sampled.get(seq.request_id, ())
            if not tokens or seq.is_finished:
                continue
            seq.num_pending -= 1
            self._append_until_stop(seq, tokens)
            if seq.status is SequenceStatus.RUNNING:
                self.kv.cache_blocks(seq.request_id, seq.token_ids,
                                     min(seq.num_computed_tokens, seq.num_tokens))
            if seq.is_finished:
                if seq in self.waiting:
                    self.waiting.remove(seq)
                self._release(seq)
                finished.append(seq)
        return finished

    def _append_until_stop(self, seq: Sequence, token_ids: Seq[int]) -> None:
        """Appends the sampled tokens up to the first that ends the sequence — EOS (unless
        ignored), a stop token, its ``max_tokens``th or the model's last — and finishes it
        there; the tokens after it are dropped. One pass over a call's tokens."""
        if not token_ids:
            return
        params = seq.params
        room = min(params.max_tokens - seq.num_output_tokens,
                   self.config.max_model_len - seq.num_tokens)
        kept = token_ids[: max(room, 1)]
        stop_ids = seq.stop_ids
        for index, token_id in enumerate(kept):
            if token_id in stop_ids:
                seq.token_ids.extend(kept[: index + 1])
                if token_id in seq.eos_token_ids and not params.ignore_eos:
                    seq.finish(FinishReason.STOP)
                else:
                    seq.finish(FinishReason.STOP, stop_reason=token_id)
                return
        seq.token_ids.extend(kept)
        if len(kept) >= room:
            seq.finish(FinishReason.LENGTH)

    def finish(self, request_id: str, reason: FinishReason, stop_reason: str | None = None) -> (
        Sequence | None
    ):
        """End a request from outside (abort, a stop string); frees its blocks at once."""
        seq = self._remove(request_id)
        if seq is not None:
            seq.finish(reason, stop_reason)
            self._release(seq)
        return seq

    def _remove(self, request_id: str) -> Sequence | None:
        seq = self.loads.forget(request_id)
        if seq is not None:
            return seq
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        seq.spec_token_ids, seq.num_model_drafts = [], 0
        num_blocks = self.kv.num_cached_blocks(seq.request_id)
        rates = self.rates.current() if self.rates is not None else None
        if swap_pays(rates, self.kv.num_missing_from_host(seq.request_id), num_blocks,
                     num_blocks * self.kv.block_size):
            self.kv.swap_out(seq.request_id)
        self.kv.free(seq.request_id)
        self._forget(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.loads.recomputes.discard(seq.request_id)
        if seq in self.running:
            self.running.remove(seq)
        self.kv.free(seq.request_id)
        self._forget(seq.request_id)

    def _forget(self, request_id: str) -> None:
        if request_id in self._known_to_workers:
            self._known_to_workers.discard(request_id)
            self._released.append(request_id)
