"""One shard of a model on one device: weights, paged KV cache, and the step that runs them.

The same class runs in the engine's process (one device) and inside a Ray actor per GPU
(tensor parallel); only the ``TensorParallelGroup`` it is given differs.
"""

from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.attention.key_centers import centers_digest, key_centers_for
from workers.call_tokens import CallTokens
from workers.deferred_tokens import (
    DeferredTokens,
    check_deferrable,
    check_read,
    fill_unread,
    read_own_tokens,
    reads_own_tokens,
    unread_inputs,
)
from workers.device_stats import DeviceStats, read_device_stats
from workers.gc_freeze import freeze_start_up_objects
from workers.host_layout import OffloadInfo, layer_tensors
from workers.input_batch import (
    DecodeRows,
    VerifyRows,
    build_decode_rows,
    build_input_batch,
    build_verify_rows,
    forward_decode_rows,
    to_device,
)
from workers.kv_cache import KVCaches, allocate_kv_caches, kv_bytes_per_block, resolve_kv_format
from workers.kv_offload import KVOffloader, blocks_in_use, blocks_of_requests
from workers.layers.batch_invariant import make_batch_invariant, needed_for
from workers.layers.parallel import TensorParallelGroup
from workers.loader import load_model
from workers.model_config import ModelConfig
from workers.pending import (
    Lookahead,
    PendingRead,
    ReadDone,
    check_lookahead_slots,
    copied_event,
    to_host,
)
from workers.rate_probes import ProbeShape, RateProbes
from workers.request_state import RequestState, TokenHistory
from workers.sampler import Sampler, SamplerOutput, SamplingSpec
from workers.speculative.device_drafts import DeviceDrafts
from workers.speculative.step_drafts import StepDrafts, with_host_drafts
from workers.speculative.verify_step import merge_outputs, verify_rows, warm_up_verify
from workers.step_input import (
    NewRequest,
    ScheduledRequest,
    StepInput,
    StepOutput,
)
from workers.step_timer import StepTimer
from workers.structured.masks import LogitConstraints
from workers.worker_config import WorkerConfig, make_attention_backend

if TYPE_CHECKING:
    from workers.speculative.eagle.drafter import EagleDrafter


class Worker:
    def __init__(self, config: WorkerConfig, tp: TensorParallelGroup | None = None) -> None:
        self.config = config
        self.tp = tp or TensorParallelGroup.single()
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._use_device()
        self.dtype = config.torch_dtype
        self.kv_format = resolve_kv_format(config.kv_cache_dtype, self.dtype, self.device)
        backend = make_attention_backend(config.attention_backend, self.device)
        read = None if config.model_config is None else ModelConfig(config.model_config)
        self.model, self.hf_config = load_model(
            config.model_path, self.dtype, self.device, self.tp, backend,
            config=read,  # type: ignore[arg-type]
        )
        if needed_for(self.device, self.kv_format.quantized):
            make_batch_invariant(self.model)
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.states: dict[str, RequestState] = {}
        self.kv_caches: KVCaches = []
        self.offloader: KVOffloader | None = None  # copies to and from the host and disk tiers
        self.step_timer: StepTimer | None = None  # the driver's on a GPU, beside the offloader
        # the last step's rows: their sequences' blocks may still be in use on the device
        self.last_scheduled: list[ScheduledRequest] = []
        # an int8 cache's keys less each layer's mean, calibrated in init_kv_cache
        self.key_centers: list[torch.Tensor] | None = None
        self.centers_digest: str | None = None
        self.graphs = None  # DecodeGraphs once captured (GPU, Triton; every rank or none)
        self.lookahead: Lookahead | None = None  # the next call's first step, already run
        # async scheduling (workers/deferred_tokens.py): the last step's tokens, on the device
        # for the next step's inputs and on their way to the host for the next call's return
        self.unread: DeferredTokens | None = None
        self.deferred_read: PendingRead | ReadDone | None = None
        self.previous_read: PendingRead | ReadDone | None = None  # the call's step before's
        self.defers = False  # the step running now keeps its tokens on the device
        # logit_bias and grammar masks (workers/structured/masks.py), once a row has either
        self.constraints: LogitConstraints | None = None
        # DraftModel, on rank 0 alone: it drafts where a step asks (num_model_drafts) and
        # broadcasts the drafts to the other ranks
        self.draft = None
        self.eagle: EagleDrafter | None = None  # an EAGLE head: drafts from the target's features
        if config.draft_model_path is not None and self.is_driver:
            self.draft = self._make_draft(backend)
        self.step_drafts = StepDrafts(self.draft, self.tp, self.device)
        self.uses_graphs = (self.device.type == "cuda" and not config.enforce_eager
                            and backend.name == "triton")

    def _make_draft(self, backend):  # type: ignore[no-untyped-def]
        config = self.config
        if config.draft_method in ("eagle", "eagle3"):
            from workers.speculative.eagle.drafter import EagleDrafter

            self.eagle = EagleDrafter(config.draft_model_path, config.draft_method, self.model,
                                      self.hf_config, self.dtype, self.device, backend,
                                      config.num_speculative_tokens, config.block_size,
                                      config.model_path if self.tp.size > 1 else None)
            return self.eagle
        from workers.speculative.draft_model import DraftModel

        return DraftModel(config.draft_model_path, self.dtype, self.device, backend,
                          config.num_speculative_tokens, config.block_size)

    def _use_device(self) -> None:
        """Makes this worker's GPU the calling thread's current device. Triton launches, graph
        replays and streams follow the current device, which is per thread: a Ray compiled
        graph calls ``execute`` from a thread of its own, where it would be cuda:0."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def is_driver(self) -> bool:
        return self.tp.rank == 0

    def device_stats(self) -> DeviceStats | None:
        """This shard's GPU utilization and memory; None on the CPU."""
        return read_device_stats(self.device, self.tp.rank)

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit: a fixed budget on the CPU, free memory on a GPU."""
        self._use_device()
        block_bytes = kv_bytes_per_block(
            self.hf_config, self.tp.size, self.config.block_size, self.dtype, self.kv_format
        ) + (self.draft.bytes_per_block() if self.draft is not None else 0)
        if self.device.type != "cuda":
            return max(1, self.config.cpu_kv_cache_bytes // block_bytes)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = self._activation_bytes() + (1 << 30)  # graphs, allocator slack
        # this process's share of the whole GPU, less what it holds already (the weights):
        # other processes on the same GPU (another replica) take their own shares
        own = total * self.config.gpu_memory_utilization - torch.cuda.memory_reserved(self.device)
        usable = min(own, free) - reserve
        return max(1, int(usable) // block_bytes)

    def _activation_bytes(self) -> int:
        """Peak memory of a forward over a full token budget, measured once."""
        num_tokens = self.config.max_num_batched_tokens
        block_size = self.config.block_size
        num_blocks = -(-num_tokens // block_size)
        self._allocate_kv_cache(num_blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        probe = NewRequest("probe", [0] * num_tokens, num_tokens, list(range(num_blocks)),
                           SamplingSpec(temperature=0.0))
        self.execute(StepInput([probe], [ScheduledRequest("probe", 0, num_tokens)], []))
        self.states.clear()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def init_kv_cache(self, num_blocks: int) -> OffloadInfo | None:
        """Allocates the cache (and the host buffer for offloaded blocks, if asked), then
        captures the decode graphs that read it. Returns the host buffer's shape, if any."""
        self._use_device()
        # before the cache: a prefill of its own (every rank at once, as this call runs)
        self.key_centers = key_centers_for(self.kv_format, self.model, self.hf_config, self.tp,
                                           self.dtype, self.device)
        self.centers_digest = centers_digest(self.key_centers, self.tp)  # a collective too
        self._allocate_kv_cache(num_blocks)
        self.offloader = None
        self.step_timer = None
        self.model.model.layer_gate = None
        if self.config.host_kv_cache_bytes:
            tensors = layer_tensors(self.kv_caches) + self._draft_block_tensors()
            block_bytes = sum(t[0].numel() * t.element_size() for t in tensors)
            num_slots = self.config.host_kv_cache_bytes // block_bytes
            if num_slots < 1:
                raise ValueError(f"host_kv_cache_gb holds no KV block: one takes "
                                 f"{block_bytes} bytes a shard")
            model_tensors = len(layer_tensors(self.kv_caches))
            self.offloader = KVOffloader(tensors, num_slots, self.config.disk_kv_cache_dir,
                                         self.tp, model_layers=(len(self.kv_caches),
                                                                model_tensors),
                                         in_place=None if self.config.host_loads_in_place
                                         else False)
            if self.offloader.pinned is not None:  # else no forward has a layer to wait for
                self.model.model.layer_gate = self.offloader.gate
            # what the steps that load and those that compute cost: the prices of loads
            on_gpu = self.device.type == "cuda"
            self.step_timer = StepTimer() if on_gpu and self.is_driver else None
        # what the engine admits: no sequence outgrows its length or the cache
        model_len = self.config.max_model_len or self.hf_config.max_position_embeddings
        max_model_len = min(model_len, num_blocks * self.config.block_size)
        self.model.build_rotary_table(max_model_len)
        if self.draft is not None:
            self.draft.build_rotary_table(max_model_len)
        if self.uses_graphs:  # the same on every rank: config, backend and device type
            from workers.cuda_graphs import DecodeGraphs, capture_on_every_rank

            self.graphs = capture_on_every_rank(
                lambda: DecodeGraphs(self.model, self.kv_caches, self.config.max_num_seqs,
                                     max_model_len, self.config.block_size, self.device),
                self.tp, self.device,
            )
        if self.graphs is not None and self.draft is not None:
            self.draft.capture_graphs(self.config.max_num_seqs)
        if self.config.num_speculative_tokens and self.device.type == "cuda" and self.is_driver:
            warm_up_verify(self.config.num_speculative_tokens, self.hf_config.vocab_size,
                           self.device)
        # a worker's start-up ends here: in a process of its own (a Ray actor) nothing else
        # freezes its model and graphs (workers/gc_freeze.py)
        freeze_start_up_objects()
        if self.offloader is None:
            return None
        return self._measure_rates(num_blocks, max_model_len)

    def _draft_block_tensors(self) -> list[torch.Tensor]:
        """What a draft keeps by block that only the target's forward makes: an EAGLE head's
        features, offloaded and loaded with the blocks' K/V (a draft model's K/V and the
        head's own are recomputed on a sequence's first draft). At TP > 1 rank 0 alone has a
        head, and every rank's slots must be alike: there the loaded blocks' features are not
        restored (drafts after a tier hit are worse there, the output the same)."""
        if self.eagle is None or self.tp.size > 1:
            return []
        return [self.eagle.block_features()]

    def _measure_rates(self, num_blocks: int, max_model_len: int) -> OffloadInfo:
        """The host buffer's shape with the rates copies are priced by: its copy bandwidth,
        the prefill rate and, on a GPU, a block's store and a loading step's
        (workers/rate_probes.py). The probes' copies and timed steps are dropped after: the
        engine's rates start from these."""
        assert self.offloader is not None
        info = self.offloader.info
        probes = RateProbes(self.execute, self.states.clear, ProbeShape(
            self.config.block_size, num_blocks, self.config.max_num_batched_tokens,
            max_model_len, self.device))
        copy_rate = self.offloader.measure_copy_bandwidth()
        prefill_rate = probes.prefill_rate()
        store_seconds = probes.store_seconds(info.num_slots)
        load_rate = probes.load_rate(copy_rate, info.num_slots, info.block_bytes)
        self.offloader.report(idle=False)
        if self.step_timer is not None:
            self.step_timer.take()
        return replace(info, copy_bytes_per_s=copy_rate, prefill_tokens_per_s=prefill_rate,
                       load_bytes_per_s=load_rate, store_seconds_per_block=store_seconds)

    def key_centers_digest(self) -> str | None:
        """The digest of every rank's key centers (the same on each), for the blocks' hash
        keys; None when keys are not centered."""
        return self.centers_digest

    def export_host_slots(self, slots: list[int]) -> torch.Tensor:
        """This shard's bytes of the host-tier slots, for another replica (kv_offload.py)."""
        if self.offloader is None:
            raise ValueError("this worker has no host KV buffer to export from")
        return self.offloader.export(slots)

    def stage_host_import(self, import_id: str, rows: torch.Tensor) -> None:
        if self.offloader is None:
            raise ValueError("this worker has no host KV buffer to import into")
        self.offloader.stage_import(import_id, rows)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.graphs = None  # graphs hold the old cache's addresses
        self.kv_caches = allocate_kv_caches(
            self.hf_config, self.tp.size, num_blocks, self.config.block_size, self.dtype,
            self.device, self.kv_format, self.key_centers,
        )
        if self.draft is not None:
            self.draft.allocate(num_blocks)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput | None:
        """Runs one step (``num_steps`` decode steps when asked), with the copies between KV
        tiers it carries around it; the driver (rank 0) returns the sampled tokens and what
        the copies finished, other ranks None."""
        self._use_device()
        self.previous_read, self.deferred_read = self.deferred_read, None
        output = self._execute_with_copies(step)
        self.last_scheduled = step.scheduled
        if step.defer_read and self.deferred_read is None and self.is_driver:
            self.deferred_read = ReadDone(StepOutput([], []))  # no row sampled
        previous, self.previous_read = self.previous_read, None
        if previous is not None and output is not None:  # read while this step runs
            output.previous = previous.result()
        return output

    def _read_previous(self) -> StepOutput:
        """The step before's tokens, now (a deferred step's rows that sample from them)."""
        previous = self.previous_read
        if previous is None:
            raise ValueError("a row has unread tokens, but no step before this one is unread")
        if not isinstance(previous, ReadDone):
            self.previous_read = previous = ReadDone(previous.result())
        return previous.output

    def _execute_with_copies(self, step: StepInput) -> StepOutput | None:
        offloader = self.offloader
        if offloader is None:
            if step.transfers is not None:
                raise ValueError("a step carries KV copies, but this worker has no host buffer")
            return self._execute(step)
        timer = self.step_timer
        if timer is not None:
            timer.start(step)
        offloader.before_step(
            step.transfers, *blocks_in_use(step, self.config.block_size),
            busy=lambda: blocks_of_requests(
                (item.request_id for item in self.last_scheduled), self.states))
        output = self._execute(step)
        offloader.after_step(step.transfers)
        report = offloader.report(idle=not step.scheduled)
        if timer is not None:
            timer.stop()
            report.steps = timer.take()
        if output is not None:
            output.transfers = report
        return output

    def _execute(self, step: StepInput) -> StepOutput | None:
        output = self._run_step(step)
        if output is not None and self.constraints is not None:
            output.grammar_failures = self.constraints.take_failures()
        if output is not None and self.draft is not None:
            output.draft_catch_up_tokens = self.draft.take_caught_up()
        return output

    def _run_step(self, step: StepInput) -> StepOutput | None:
        lookahead, self.lookahead = self.lookahead, None  # good for the very next call only
        unread, self.unread = self.unread, None  # the step before's tokens: this step's inputs
        self.defers = step.defer_read
        for request_id in step.released_ids:
            self.states.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(step.released_ids)
        for request in step.new_requests:
            self.states[request.request_id] = RequestState.from_new(request, self.device,
                                                                    self.is_driver)
        for item in step.scheduled:
            self.states[item.request_id].apply(item)
        if not step.scheduled:
            return StepOutput([], []) if self.is_driver else None
        if step.defer_read:
            check_deferrable(step)
        if step.num_steps > 1:
            if unread is not None:  # placeholders follow a deferred step only
                check_read([self.states[item.request_id] for item in step.scheduled],
                           [item.num_computed_tokens + 1 for item in step.scheduled])
            return self._execute_decode_steps(step.scheduled, step.num_steps, step.lookahead,
                                              lookahead)
        scheduled, on_device = self.step_drafts.fill(
            step.scheduled, self.states, lambda states: self._constraints_for(states) is not None)
        verify = build_verify_rows(scheduled, self.states, self.config.block_size)
        if verify is not None:
            return self._execute_verify(verify, on_device)
        if on_device is not None:  # not a step of decodes alone: its drafts go as tokens
            scheduled = with_host_drafts(scheduled, on_device)
        if self.graphs is not None:
            rows = build_decode_rows(scheduled, self.states, self.config.block_size)
            hidden = None
            if rows is not None:
                hidden = self.graphs.run(rows, unread_inputs(unread, rows, self.states,
                                                            self.device))
            if hidden is not None:  # every rank replayed the same bucket: graphs run in lockstep
                return self._sample_and_read(rows.request_ids, hidden)
        batch = build_input_batch(scheduled, self.states, self.config.block_size, self.device)
        fill_unread(unread, batch.input_ids, scheduled, self.states)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if self.eagle is not None:
            self.eagle.store(batch.meta.slot_mapping, hidden)
        if not batch.sample_request_ids:
            return StepOutput([], []) if self.is_driver else None
        if batch.draft_token_ids is not None:
            return self._verify_and_read(batch.sample_request_ids, batch.draft_token_ids,
                                         hidden[batch.sample_indices])
        return self._sample_and_read(batch.sample_request_ids, hidden[batch.sample_indices])

    def _execute_verify(self, verify: VerifyRows,
                        on_device: DeviceDrafts | None) -> StepOutput | None:
        """A step of decodes with drafts, as decode rows (workers/input_batch.py): graphed
        when a bucket holds its rows; drafts ``on_device`` are read there, by the forward and
        the verify alike."""
        input_ids = None
        if on_device is not None:
            starts = np.cumsum([0] + [1 + len(d) for d in verify.drafts])[:-1]
            input_ids = on_device.verify_input(
                verify.rows.input_ids, [int(starts[r]) for r, d in enumerate(verify.drafts) if d])
        hidden = self._forward_decode(verify.rows, input_ids)
        return self._verify_and_read(verify.request_ids, verify.drafts, hidden, on_device)

    def _execute_decode_steps(self, scheduled: list[ScheduledRequest], num_steps: int,
                              run_lookahead: bool = False,
                              previous: Lookahead | None = None) -> StepOutput | None:
        """``num_steps`` decode steps back to back. Each step's input tokens are the ones the
        step before sampled, handed over on the device (broadcast from rank 0 under tensor
        parallelism), so the host queues step after step without waiting for any, and reads
        every token once at the end. The scheduler has allocated the slots of all of them.

        With ``run_lookahead`` one step more runs after them, the next call's first, kept in
        ``self.lookahead``: it is on the device while the host reads this call's tokens and
        schedules the next. A call that continues from ``previous`` (each of its sequences one
        that ``previous`` stepped, at the position it stepped; the others have finished) takes
        those rows of it as its first step instead of running it again."""
        first = build_decode_rows(scheduled, self.states, self.config.block_size)
        if first is None:
            raise ValueError("num_steps > 1 needs a step where every sequence decodes")
        states = [self.states[r] for r in first.request_ids]
        if run_lookahead and any(s.needs_single_steps or s.grammar is not None for s in states):
            raise ValueError("a lookahead step cannot follow a row whose sampling needs every "
                             "token (penalties, min_tokens, a grammar)")
        # the driver reads each step's tokens for the rows with a grammar while the next
        # forward runs, so their next mask sees them (workers/call_tokens.py)
        reads = CallTokens(states) if self.is_driver and any(
            s.grammar is not None for s in states) else None
        current = reads.request_ids if reads is not None else frozenset()
        if run_lookahead:
            check_lookahead_slots(first, num_steps, self.states, self.config.block_size)
        tokens: torch.Tensor | None = None  # (B,) on the device: the last step's samples
        outputs: list[SamplerOutput] = []
        start = 0
        picks = previous.rows_continued_by(first) if previous is not None else None
        if picks is not None:
            tokens, taken = previous.taken_up(picks)
            start = 1
            if taken is not None:
                outputs.append(taken)
                if reads is not None:
                    reads.start(taken.token_ids)
        total = num_steps + 1 if run_lookahead else num_steps
        read: PendingRead | None = None
        for index in range(start, total):
            if index == num_steps and self.is_driver:
                # this call's tokens start for the host before the lookahead is queued: the
                # host waits for them alone, and schedules while the device runs the lookahead
                read = self._start_read(first.request_ids, outputs)
            rows = first.advanced(index, self.config.block_size) if index else first
            logits = self.model.compute_logits(self._forward_decode(rows, tokens))  # collective
            if self.is_driver:
                if reads is not None and index:
                    reads.finish()  # the step before's tokens into the grammar rows' states
                outputs.append(self._sample(rows.request_ids, logits, offset=index,
                                            current=current))
                tokens = outputs[-1].token_ids
                if reads is not None and index + 1 < total:
                    reads.start(tokens)
            # every rank feeds the next step (the lookahead's: the next call's second)
            if index + 1 < total or run_lookahead:
                tokens = self._from_driver(tokens, len(rows.request_ids))
        if run_lookahead:
            assert tokens is not None
            self.lookahead = Lookahead(first.request_ids, first.positions + num_steps, tokens,
                                       outputs[-1] if self.is_driver else None)
        if not self.is_driver:
            return None
        return (read or self._start_read(first.request_ids, outputs)).result()

    def _from_driver(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor | None:
        """Rank 0's sampled tokens, on every rank (a broadcast under tensor parallelism)."""
        if self.tp.size == 1:
            return tokens
        if tokens is None:
            tokens = torch.empty(count, dtype=torch.int64, device=self.device)
        return self.tp.broadcast(tokens, src=0)

    def _forward_decode(self, rows: DecodeRows, input_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = forward_decode_rows(self.model, self.kv_caches, self.graphs, rows, self.device,
                                     input_ids)
        if self.eagle is not None:
            self.eagle.store(to_device(rows.slots, self.device), hidden)
        return hidden

    def _sample_and_read(self, request_ids: list[str], hidden: torch.Tensor) -> StepOutput | None:
        logits = self.model.compute_logits(hidden)  # a collective under TP
        sampled = self._sample(request_ids, logits) if self.is_driver else None
        if self.defers:  # the tokens stay on the device; the next call returns them
            tokens = self._from_driver(sampled.token_ids if sampled else None, len(request_ids))
            assert tokens is not None
            self.unread = DeferredTokens(request_ids, tokens)
            for request_id in request_ids:
                self.states[request_id].add_placeholder()
            if sampled is None:
                return None
            self.deferred_read = self._start_read(request_ids, [sampled])
            return StepOutput([], [])
        if sampled is None:
            return None
        return self._start_read(request_ids, [sampled]).result()

    def _verify_and_read(self, request_ids: list[str], drafts: list[list[int]],
                         hidden: torch.Tensor,
                         on_device: DeviceDrafts | None = None) -> StepOutput | None:
        """A step with drafts: rows without any sample as ever; rows with some keep the
        drafts the target agrees with and one token more (workers/speculative/verify_step.py)."""
        logits = self.model.compute_logits(hidden)  # (sum of 1 + k, V); a collective under TP
        if not self.is_driver:
            return None
        starts = np.cumsum([0] + [1 + len(d) for d in drafts])
        plain = [row for row, d in enumerate(drafts) if not d]
        spec = [row for row, d in enumerate(drafts) if d]
        read = None
        if plain:
            plain_ids = [request_ids[row] for row in plain]
            index = to_device(starts[plain], logits.device)  # pinned: no wait for the forward
            read = self._start_read(plain_ids, [self._sample(plain_ids, logits[index])])
        states = [self.states[request_ids[row]] for row in spec]
        pending = verify_rows(logits, [int(starts[row]) for row in spec],
                              [drafts[row] for row in spec], states, self.sampler.generator,
                              self._constraints_for(states),
                              on_device.table if on_device is not None else None)
        plain_out = read.result() if read is not None else None
        return merge_outputs(request_ids, plain, plain_out, spec, pending.result())

    def _sample(self, request_ids: list[str], logits: torch.Tensor, offset: int = 0,
                current: AbstractSet[str] = frozenset()) -> SamplerOutput:
        """Samples each row's next token (``offset`` tokens past what the state holds, but
        for the rows in ``current``, whose states hold the call's tokens so far), on the
        device: nothing is read back here."""
        states = [self.states[request_id] for request_id in request_ids]
        # only a deferred step's rows hold a placeholder: no scan of the rows in other steps
        if offset == 0 and self.previous_read is not None and any(
                s.num_placeholders and reads_own_tokens(s) for s in states):
            read_own_tokens(states, self._read_previous())  # while the forward runs
        constraints = self._constraints_for(states)
        if constraints is not None:
            # past a call's first step a row that needs every token keeps none of its samples
            # (router/scheduler.py): its history, a step behind, is not asked; a grammar's
            # row holds the call's tokens so far (CallTokens)
            masked = states if offset == 0 else [None if s.needs_single_steps else s
                                                 for s in states]
            logits, _ = constraints.apply(logits, masked)
        return self.sampler(
            logits,
            [state.spec for state in states],
            TokenHistory(states, lambda state: state.prompt_token_ids),
            TokenHistory(states, lambda state: state.output_token_ids),
            [state.generator_for_next_token(0 if state.request_id in current else offset)
             for state in states],
        )

    def _constraints_for(self, states: list[RequestState]) -> "LogitConstraints | None":
        """The mask buffers, when a row has a grammar or a logit_bias (made on first use)."""
        if not any(s.grammar is not None or s.spec.logit_bias for s in states):
            return None
        if self.constraints is None:
            self.constraints = LogitConstraints(self.hf_config.vocab_size, self.device)
        return self.constraints

    def _start_read(self, request_ids: list[str], outputs: list[SamplerOutput]) -> PendingRead:
        """Queues the one device-to-host copy of a call (every step's tokens, and logprobs if
        asked) behind the steps so far; its result() waits for that copy only."""
        token_ids = torch.stack([out.token_ids for out in outputs], dim=1)  # (B, steps)
        logprobs = None
        if outputs[0].logprobs is not None:
            logprobs = [(to_host(out.logprobs), to_host(out.logprob_token_ids)) for out in outputs]
        widths = [1 + (self.states[r].spec.logprobs or 0) for r in request_ids]
        host_token_ids = to_host(token_ids)
        return PendingRead(request_ids, host_token_ids, logprobs, widths, copied_event(token_ids))
