"""The engine of one replica: requests in, a step at a time, outputs out.

Each ``step()`` asks the scheduler what to run, sends the workers one ``StepInput``, commits
the sampled tokens, and turns them into ``RequestOutput``s (text, stop strings, metrics).

What one request raises while its tokens become text fails that request alone
(``RequestFailed``, its blocks freed at once); the step and the other requests go on.
"""

import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path

from cluster.engine.config import EngineConfig
from cluster.engine.engine_setup import (
    check_draft_before_download,
    check_draft_model,
    make_executor,
)
from cluster.engine.executor import Executor
from cluster.engine.grammars import GrammarCompiles, GrammarViolation
from cluster.engine.kv_events import KVEventPublisher
from cluster.engine.kv_tiers import (
    TierTraffic,
    describe_rates,
    make_rates,
    make_tiers,
)
from cluster.engine.metrics import EngineMetrics, LoadSample, MetricsSnapshot, cache_config_info
from cluster.engine.output_processor import (
    RequestTracker,
    add_token,
    finish_completion,
    make_tracker,
)
from cluster.engine.outputs import (
    EngineStats,
    RequestDelta,
    RequestFailed,
    RequestOutput,
    part_ids,
)
from cluster.engine.request_metrics import record_finish, record_tokens
from cluster.engine.resume import Resume, prime, resumed_sequence
from cluster.engine.speculation import DraftActorProposer, Speculator
from cluster.engine.step_builder import StepBuilder
from cluster.engine.tokenizer import (
    Message,
    apply_chat_template,
    check_text,
    eos_token_ids,
    load_tokenizer,
)
from kvstore.disk_tier import check_directory
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.kv_format import ACCURACY_NOTES, hash_key_of
from router.sampling_params import SEED_END, SamplingParams
from router.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from router.sequence import FinishReason, Sequence
from workers.catalog import resolve_model
from workers.device_stats import DeviceStats
from workers.gc_freeze import freeze_start_up_objects, unfreeze
from workers.loader import load_config
from workers.models.llama import check_tensor_parallel
from workers.speculative.config import SpeculativeConfig
from workers.step_input import StepInput, StepOutput

log = logging.getLogger(__name__)

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 replica_index: int | None = None) -> None:
        """``replica_index``: the engine serves that replica of a cluster and keeps its KV
        events for the cluster's directory (``kv_events``); otherwise they are dropped."""
        # async scheduling decided once (None: on a GPU), not on every step's _pipelines
        self.config = config = replace(config,
                                       async_scheduling=config.resolved_async_scheduling)
        self.model_path = resolve_model(config.model, config.cache_dir)
        hf_config = load_config(self.model_path)
        self.vocab_size = hf_config.vocab_size
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, self.tokenizer)
        speculation = config.speculation
        if speculation is not None and speculation.uses_head:  # refused before shards start
            from workers.speculative.eagle.head_config import read_head_config

            assert speculation.model is not None
            read_head_config(resolve_model(speculation.model, config.cache_dir), hf_config,
                             speculation.method, config.max_model_len)
        elif speculation is not None and speculation.model is not None:
            check_draft_before_download(speculation.model, hf_config)
            check_draft_model(resolve_model(speculation.model, config.cache_dir), hf_config)
        check_tensor_parallel(hf_config, config.tensor_parallel_size)  # before shards start
        if config.disk_kv_cache_dir is not None:  # before the model loads
            check_directory(Path(config.disk_kv_cache_dir))
        self.executor = executor or make_executor(config, self.model_path, hf_config.to_dict())
        num_blocks = config.num_kv_blocks or self.executor.determine_num_kv_blocks()
        offload = self.executor.init_kv_cache(num_blocks)
        tiers = make_tiers(config, offload)
        # a block's bytes over every shard, for the bytes-moved metrics
        self.offload_block_bytes = offload.block_bytes * config.tensor_parallel_size \
            if offload else 0
        self.offload_layout = offload.layout_tag if offload else None  # what peers must match
        # measured at start-up (with a host tier): they price copies against recomputes
        self.transfer_rates = make_rates(offload, config.tensor_parallel_size)
        if self.transfer_rates is not None:
            log.info(describe_rates(self.transfer_rates, config.block_size))
        self.kv_capacity = num_blocks * config.block_size
        self.model_len = config.max_model_len or hf_config.max_position_embeddings
        # a sequence must fit the cache alone, or preempting everyone else would not save it;
        # without chunked prefill it must also fit one step (its prompt, or its recompute)
        self.max_model_len = min(self.model_len, self.kv_capacity)
        if not config.enable_chunked_prefill:
            self.model_len = min(self.model_len, config.max_num_batched_tokens)
            self.max_model_len = min(self.max_model_len, config.max_num_batched_tokens)
        # the model as the user named it isolates caches of different models, and a quantized
        # format blocks of another format (one a tier or a peer could hand over); the router
        # hashes prompts with the same keys (kv_hash_keys) to find them in the directory
        if config.kv_cache_dtype in ACCURACY_NOTES:
            log.warning(ACCURACY_NOTES[config.kv_cache_dtype])
        format_key = hash_key_of(config.kv_cache_dtype)  # with the keys' rotation: kvstore
        extra_keys = (config.model,) if format_key is None else (config.model, format_key)
        centers = self.executor.key_centers_digest()  # int8 keys less a calibrated mean
        if centers is not None:
            extra_keys += (f"key-centers={centers}",)
        self.kv_hash_keys = (config.block_size, extra_keys)
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                            extra_keys=self.kv_hash_keys[1], tiers=tiers)
        self.replica_index = replica_index
        self.kv_events = None if replica_index is None else KVEventPublisher(kv, replica_index)
        self.scheduler = Scheduler(SchedulerConfig(
            self.max_model_len, config.max_num_batched_tokens, config.max_num_seqs,
            config.max_prefill_chunk,
            decode_steps=config.resolved_decode_steps,
            decode_lookahead=config.decode_lookahead,
            enable_chunked_prefill=config.enable_chunked_prefill,
            scheduler_delay_factor=config.scheduler_delay_factor,
            tpot_target_ms=config.tpot_target_ms,
        ), kv, rates=self.transfer_rates)
        self.step_builder = StepBuilder()
        self.in_flight: SchedulerOutput | None = None  # launched, read with the next call
        self.requests: dict[str, RequestTracker] = {}
        self.seq_to_request: dict[str, str] = {}
        self._ids = itertools.count()
        self.metrics = EngineMetrics()
        self.cache_config = cache_config_info(
            config.block_size, config.kv_cache_dtype, config.enable_prefix_caching,
            config.gpu_memory_utilization, num_blocks, tiers.host.num_slots if tiers else None)
        self.grammars = GrammarCompiles(self.tokenizer, self.model_path, self.vocab_size,
                                        self.eos_token_ids)
        self.speculator = None if speculation is None else Speculator(
            speculation, self.metrics, self._draft_actor(speculation, num_blocks, replica_index))
        freeze_start_up_objects()  # full collections would walk all of the above each time

    def _draft_actor(self, speculation: SpeculativeConfig, num_blocks: int,
                     replica_index: int | None) -> DraftActorProposer | None:
        """The cluster's draft actor with a cache for this engine, for placement "actor"."""
        if speculation.model is None or speculation.placement != "actor":
            return None
        from cluster.ray.draft_actor import draft_actor

        config = self.config
        actor = draft_actor(str(resolve_model(speculation.model, config.cache_dir)),
                            config.dtype, config.resolved_device, config.block_size,
                            speculation.num_speculative_tokens, config.attention_backend,
                            speculation.draft_gpus)
        # an engine of its own in the cluster: the replica's index, else a name of its own
        replica = f"replica-{replica_index}" if replica_index is not None else f"engine-{id(self)}"
        import ray

        ray.get(actor.attach.remote(replica, num_blocks, self.max_model_len))
        return DraftActorProposer(actor, replica)

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            check_text(prompt, "prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, resume: Resume | None = None) -> str:
        """Queues a request; bad input raises ValueError and changes nothing. ``resume``: the
        request was started on a replica that was lost; it continues from what that one sent
        (resume.py)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        prompt_ids = self.tokenize(prompt)
        self.check_prompt(prompt_ids)
        self.check_constraints(params)
        if resume is not None:
            resume.check(params)
            for done in resume.completions:  # the emitted tokens must fit as a prompt does
                self.check_prompt(prompt_ids + list(done.token_ids))
        seq_ids = part_ids(request_id, params.n)
        text = prompt if isinstance(prompt, str) else None
        try:
            tracker = make_tracker(request_id, text, prompt_ids, params, seq_ids, self.tokenizer)
            if resume is not None:
                prime(tracker, resume, params)
        except Exception as error:  # the detokenizer's set-up: the server's fault, not the input's
            log.error("request %s: setting up its detokenizer failed", request_id, exc_info=True)
            raise RequestFailed(failure_message(request_id, "setting up its detokenizer",
                                                error)) from None
        self.requests[request_id] = tracker
        sequences = []
        for index, seq_id in enumerate(seq_ids):
            done = resume.completions[index] if resume is not None else None
            if done is not None and done.finish_reason is not None:
                continue  # this one of n had finished: it has nothing left to run
            seq_params = params
            if params.n > 1 and params.seed is not None:  # distinct, reproducible samples;
                # modulo 2**64 the generator is the same (manual_seed's two's complement), and
                # seed + index stays a seed it takes
                seq_params = replace(params, seed=(params.seed + index) % SEED_END)
            self.seq_to_request[seq_id] = request_id
            seq = Sequence(seq_id, prompt_ids, seq_params, self.eos_token_ids,
                           arrival_time=tracker.metrics.arrival_time)
            sequences.append(seq if done is None else resumed_sequence(seq, done))
        if params.structured_outputs is not None:  # they join once their grammar is compiled
            self.grammars.add(request_id, params.structured_outputs, sequences)
        else:
            for seq in sequences:
                self.scheduler.add(seq)
        return request_id

    def check_constraints(self, params: SamplingParams) -> None:
        """logit_bias's token ids in the vocabulary; a structured output's grammar one the
        backend can build (a bad regex, a $ref to nothing: ValueError naming the field)."""
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of range for a vocabulary "
                             f"of {self.vocab_size}")
        if params.structured_outputs is None:
            return
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model "
                             "has none")
        from workers.structured.backend import check_convertible

        check_convertible(params.structured_outputs)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of "
                             f"{self.vocab_size}")
        if len(prompt_ids) >= self.max_model_len:
            limit = (f"max_model_len is {self.model_len}" if self.model_len <= self.kv_capacity
                     else f"the KV cache holds {self.kv_capacity} tokens")
            raise ValueError(f"prompt has {len(prompt_ids)} tokens: {limit}, "
                             "which leaves no room to generate")

    def abort(self, request_id: str) -> None:
        """Ends a request at once and frees its blocks; unknown ids are ignored."""
        tracker = self.requests.pop(request_id, None)
        if tracker is None:
            return
        self.grammars.drop(request_id)
        for seq_id, completion in tracker.completions.items():
            seq = self.scheduler.finish(seq_id, FinishReason.ABORT)
            if seq is not None:
                finish_completion(completion, seq)
            self.seq_to_request.pop(seq_id, None)
            if self.speculator is not None:
                self.speculator.forget([seq_id])
        self.metrics.on_finish("abort", time.monotonic() - tracker.metrics.arrival_time)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammars.waiting) or (
            self.in_flight is not None)

    def has_pending_transfers(self) -> bool:
        """Copies between tiers wait for a step (write-through of the last step's blocks):
        an idle replica runs one, so its host tier holds what its device cache does."""
        tiers = self.scheduler.kv.tiers
        return tiers is not None and bool(tiers.pending or not tiers.plan.is_empty)

    # -- the step ---------------------------------------------------------------------------

    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Runs one step; the outputs of the requests it advanced (whole copies of each).

        ``only_finished``: return only finished requests' outputs, for callers that do not
        stream (``LLM.generate``); copying every running request's tokens each step is the
        largest per-step cost at large batches.
        """
        touched = self._advance()
        outputs = [t.snapshot() for t in touched if not only_finished or t.finished]
        self._drop_finished(touched)
        return outputs

    def step_deltas(self) -> list[RequestDelta]:
        """Runs one step; what each advanced request gained in it (for streaming)."""
        touched = self._advance()
        deltas = [t.delta() for t in touched]
        self._drop_finished(touched)
        return deltas

    def _advance(self) -> list[RequestTracker]:
        if self.kv_events is None:
            self.scheduler.kv.take_events()  # nobody reads them: don't let them pile up
        failed = self._admit_compiled()
        if failed:
            return failed
        if self.grammars.waiting and not self.scheduler.has_unfinished() and (
                self.in_flight is None):
            self.grammars.wait(0.01)  # nothing else to run: wait a little for a grammar
            return self._admit_compiled()
        pipelines = self._pipelines()
        if self.in_flight is not None and not pipelines:
            return self._read_in_flight()  # the next step is scheduled with every token known
        scheduled = self.scheduler.schedule()
        transfers = self.scheduler.kv.take_transfers()
        if scheduled.is_empty and not scheduled.released_ids and transfers is None and (
                not self.scheduler.loading):
            return self._read_in_flight()
        started = time.perf_counter()
        step = self.step_builder.build(scheduled, transfers)
        if self.speculator is not None:
            step = self.speculator.before_step(step)
        step.defer_read = pipelines and scheduled.num_steps == 1
        if step.defer_read:
            self.scheduler.launched(scheduled)
        result = self.executor.execute(step)
        seconds = time.perf_counter() - started
        if result.transfers is not None and not result.transfers.is_empty:
            for load in self.scheduler.apply_transfers(result.transfers).values():
                self.metrics.kv_load_latency.observe(load.seconds)
        touched = self._commit_in_flight(result.previous, seconds)
        if step.defer_read:
            self.in_flight = scheduled
        else:
            touched += self._commit(scheduled, result, seconds)
        return unique(touched)

    def _pipelines(self) -> bool:
        """Whether the next step may be scheduled before the last one is read (async
        scheduling): not when a sequence's drafts need its tokens on the host (drafts next
        step; speculation that is off runs ahead until its next try), and not when every
        sequence decodes and several decode steps a call would run (``decode_steps``): those
        calls overlap by their own lookahead. Rows whose sampling reads their tokens (a
        grammar, penalties) pipeline: the worker reads the one they lack while the step's
        forward runs (workers/deferred_tokens.py)."""
        scheduler = self.scheduler
        if not self.config.async_scheduling or (
                self.speculator is not None and not self.speculator.runs_ahead(scheduler.running)):
            return False
        running = scheduler.running
        return not (scheduler.config.decode_steps > 1 and not scheduler.waiting and all(
            seq.num_computed_tokens >= seq.num_prompt_tokens for seq in running) and not all(
            seq.samples_one_at_a_time for seq in running))

    def _read_in_flight(self) -> list[RequestTracker]:
        """Reads the step in flight (a call with nothing to run), if there is one."""
        if self.in_flight is None:
            return []
        started = time.perf_counter()
        result = self.executor.execute(StepInput([], [], []))
        return self._commit_in_flight(result.previous, time.perf_counter() - started)

    def _commit_in_flight(self, result: StepOutput | None,
                          seconds: float) -> list[RequestTracker]:
        scheduled, self.in_flight = self.in_flight, None
        if scheduled is None:
            return []
        assert result is not None, "the workers return a deferred step's tokens with the next"
        return self._commit(scheduled, result, seconds)

    def _commit(self, scheduled: SchedulerOutput, result: StepOutput,
                seconds: float) -> list[RequestTracker]:
        """A step's sampled tokens into its sequences and their requests' outputs."""
        self.scheduler.observe_step(scheduled, seconds)
        sampled = dict(zip(result.request_ids, result.token_ids, strict=True))
        self.metrics.on_step(len(scheduled.scheduled))
        scheduled_seqs = {item.seq.request_id: item.seq for item in scheduled.scheduled}
        num_before = {seq_id: seq.num_tokens for seq_id, seq in scheduled_seqs.items()}
        finished = {seq.request_id: seq for seq in self.scheduler.update(scheduled, sampled)}
        now = time.monotonic()
        touched: dict[str, RequestTracker] = {}
        for row, seq_id in enumerate(result.request_ids):
            request_id = self.seq_to_request.get(seq_id)
            if request_id is None:
                continue  # aborted while its step ran, or failed on an earlier row
            tracker = self.requests[request_id]
            touched[request_id] = tracker
            try:  # detokenizing and stop strings run the request's own text through code
                completion = tracker.completions[seq_id]
                seq = scheduled_seqs[seq_id]
                kept = result.token_ids[row][: seq.num_tokens - num_before[seq_id]]  # to a stop
                num_output = len(kept)
                for index, token_id in enumerate(kept):
                    logprobs = result.logprobs[row][index] if result.logprobs is not None \
                        else None
                    stop = add_token(completion, tracker.params, token_id, logprobs)
                    if stop is None:
                        continue
                    num_output = index + 1  # a stop string: the tokens after it are dropped
                    if seq_id not in finished:
                        if self.scheduler.finish(seq_id, FinishReason.STOP, stop_reason=stop):
                            finished[seq_id] = seq
                    else:  # finished by length or EOS on a token at or after the stop string
                        seq.finish(FinishReason.STOP, stop_reason=stop)
                    break
                record_tokens(self.metrics, tracker, completion, seq, now, num_output, len(kept))
                if seq_id in finished:
                    finish_completion(completion, finished[seq_id])
                    record_finish(self.metrics, tracker, finished[seq_id], now)
            except Exception as error:
                self._fail(tracker, "turning its tokens into text", error)
        broken = self._fail_broken_grammars(result.grammar_failures)
        if self.speculator is not None:
            self.speculator.observe(scheduled, sampled, seconds, result.draft_catch_up_tokens)
            self.speculator.forget(finished)
            self.speculator.propose(self.scheduler.running)
        return list(touched.values()) + [t for t in broken if t.request_id not in touched]

    def _admit_compiled(self) -> list[RequestTracker]:
        """Sequences whose grammar is compiled join the scheduler; a request whose grammar
        failed ends with the error (returned, for its output)."""
        failed = []
        for waiting, grammar, error in self.grammars.ready():
            tracker = self.requests.get(waiting.request_id)
            if tracker is None:
                continue  # aborted while it compiled
            if error is not None:
                self._fail(tracker, "compiling its grammar", error)  # type: ignore[arg-type]
                failed.append(tracker)
                continue
            for seq in waiting.sequences:
                seq.grammar = grammar
                self.scheduler.add(seq)
        return failed

    def _fail_broken_grammars(self, failures: list[tuple[str, str]]) -> list[RequestTracker]:
        """Requests whose output broke their grammar (a fault of the masks' path, never the
        client's) end with an error; the rest of the step goes on."""
        broken = []
        for seq_id, why in failures:
            request_id = self.seq_to_request.get(seq_id)
            if request_id is None:
                continue
            tracker = self.requests[request_id]
            self._fail(tracker, "following its grammar", GrammarViolation(why))
            broken.append(tracker)
        return broken

    def _fail(self, tracker: RequestTracker, stage: str, error: Exception) -> None:
        """Ends one request that raised: its sequences are aborted (blocks freed), its next
        output carries the error; nothing else in the step is touched."""
        request_id = tracker.request_id
        log.error("request %s failed while %s", request_id, stage, exc_info=error)
        tracker.error = failure_message(request_id, stage, error)
        for seq_id, completion in tracker.completions.items():
            self.seq_to_request.pop(seq_id, None)  # its later rows in this step are skipped
            if completion.output.finish_reason is None:
                self.scheduler.finish(seq_id, FinishReason.ABORT)  # None if it just finished
                completion.output.finish_reason, completion.output.stop_reason = "abort", None
        if self.speculator is not None:
            self.speculator.forget(list(tracker.completions))
        self.metrics.on_finish("abort", time.monotonic() - tracker.metrics.arrival_time)

    def _drop_finished(self, trackers: list[RequestTracker]) -> None:
        for tracker in trackers:
            if tracker.finished:
                self._drop(tracker.request_id)

    def _drop(self, request_id: str) -> None:
        tracker = self.requests.pop(request_id)
        for seq_id in tracker.completions:
            self.seq_to_request.pop(seq_id, None)

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_blocks,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            spec_decode_num_drafts=self.metrics.spec_decode_drafts,
            spec_decode_num_draft_tokens=self.metrics.spec_decode_draft_tokens,
            spec_decode_num_accepted_tokens=self.metrics.spec_decode_accepted_tokens,
            host_cache_hits=kv.stats.host_hits, disk_cache_hits=kv.stats.disk_hits,
            kv_pulled_tokens=kv.tiers.counters.imported * kv.block_size if kv.tiers else 0,
            kv_exported_tokens=kv.tiers.counters.exported * kv.block_size if kv.tiers else 0,
        )

    def metrics_snapshot(self) -> MetricsSnapshot:
        m, stats = self.metrics, self.stats()
        tiers = self.scheduler.kv.tiers
        traffic = TierTraffic.of(tiers.counters if tiers else None, self.offload_block_bytes)
        return MetricsSnapshot(
            m.time_to_first_token.copy(), m.inter_token_latency.copy(), m.e2e_latency.copy(),
            m.queue_time.copy(), m.prompt_tokens, m.generation_tokens,
            dict(m.finished_requests), stats.num_preemptions, stats.prefix_cache_queries,
            stats.prefix_cache_hits, stats.num_running, stats.num_waiting, m.batch_size,
            stats.kv_blocks_used, stats.kv_blocks_total, m.spec_decode_drafts,
            m.spec_decode_draft_tokens, m.spec_decode_accepted_tokens,
            tuple(m.spec_decode_accepted_per_position), m.spec_decode_speedup,
            m.batch_sizes.copy(), m.request_tokens_per_second.copy(),
            self._device_stats(), self.replica_index,
            host_cache_hits=stats.host_cache_hits, disk_cache_hits=stats.disk_cache_hits,
            kv_offloaded_bytes=traffic.offloaded, kv_loaded_bytes=traffic.loaded,
            kv_load_latency=m.kv_load_latency.copy(),
            request_prompt_tokens=m.request_prompt_tokens.copy(),
            request_generation_tokens=m.request_generation_tokens.copy(),
            request_prefill_time=m.request_prefill_time.copy(),
            request_decode_time=m.request_decode_time.copy(),
            cache_config=dict(self.cache_config),
        )

    def _device_stats(self) -> tuple[DeviceStats, ...]:
        try:
            return tuple(self.executor.device_stats())
        except Exception:  # a shard that died: the next step finds out and rebuilds
            log.warning("could not read the shards' device stats", exc_info=True)
            return ()

    def load_sample(self) -> LoadSample:
        """The autoscaler's signals: cheap enough to take every second."""
        kv, scheduler = self.scheduler.kv, self.scheduler
        # prompt tokens still to compute: the waiting ones', and what running prefills lack
        waiting = sum(seq.num_tokens - seq.num_computed_tokens for seq in scheduler.waiting)
        waiting += sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                       for seq in scheduler.running)
        return LoadSample(waiting, len(scheduler.running),
                          kv.num_used_blocks / max(kv.num_blocks, 1),
                          tuple(self.metrics.time_to_first_token.counts))

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
        unfreeze()  # what the engine leaves in reference cycles can be collected again


def unique(trackers: list[RequestTracker]) -> list[RequestTracker]:
    """Each request once (two steps committed in one call can both touch it), in order."""
    return list({id(tracker): tracker for tracker in trackers}.values())


def failure_message(request_id: str, stage: str, error: Exception) -> str:
    """What the client is told: the stage and the kind of error, not its text (which can
    carry paths or values of the server's); the log has the whole exception."""
    return (f"the engine failed request {request_id} while {stage} "
            f"({type(error).__name__}); other requests were not affected")
