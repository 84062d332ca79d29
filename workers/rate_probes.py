"""What a replica can do alone, measured at start-up for the prices of KV copies against
recomputes (router/kv_pricing.py): its prefill rate and, on a GPU, what loading a prefix from the
host tier adds to a step. Each probe is a few steps through the worker's own ``execute``, so
every rank runs them together, into blocks and host slots no request holds yet; each step is
timed the second time it runs (the first warms up).

The load probe prices a load as the running engine does (router/live_rates.py): a step that
prefills ``Q`` tokens is timed alone, and a step of one sequence that loads ``L`` blocks of
prefix and computes ``Q`` tokens after them; what the second costs beyond the first is the
load's: its copies, and the attention of those tokens over the long loaded context, which runs
on few programs (probably why a loading step cost more than its tokens on a small model,
docs/benchmarks.md). Alone: a prefill beside it, attending over as many keys in the same
launch, would hide that time.

The store probe times a prefill alone and with its full blocks written to host slots after its
forward, as the write-through writes them: what that adds, a block, is the store's cost. On a
small model a block's store and load cost about what recomputing it does, and the engine then
writes no blocks through to the host tier (router/kv_pricing.py store_pays).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.transfers import BlockLoad, KVTransfers
from workers.sampler import SamplingSpec
from workers.step_input import NewRequest, ScheduledRequest, StepInput

PREFILL_TOKENS = {"cuda": 2048, "cpu": 256}  # a probe prefill's length, at most
LOAD_PREFIX_TOKENS = 2048  # a loading probe's prefix (loaded), at most
LOAD_QUESTION_TOKENS = 128  # and the tokens it computes after it (a repeat's new question)
PREFILL_ID, LOAD_ID = "probe", "probe-load"


@dataclass(frozen=True)
class ProbeShape:
    """What the probes may use: the worker's limits."""

    block_size: int
    num_blocks: int  # in the device pool
    max_num_batched_tokens: int
    max_model_len: int
    device: torch.device


class RateProbes:
    def __init__(self, execute: Callable[[StepInput], object], clear: Callable[[], None],
                 shape: ProbeShape) -> None:
        """``execute``: one step, as the worker runs it; ``clear``: drops the requests' state."""
        self.execute = execute
        self.clear = clear
        self.shape = shape

    def prefill_rate(self) -> float:
        """Prompt tokens a second of one probe prefill."""
        num_tokens = max(1, self._prefill_len())
        return num_tokens / self._timed(lambda: self._prefill_step(num_tokens, None))

    def _prefill_len(self) -> int:
        """A probe prefill's tokens: as many as a step, the pool and the model hold, at most
        ``PREFILL_TOKENS``."""
        shape = self.shape
        return min(shape.max_num_batched_tokens, PREFILL_TOKENS[shape.device.type],
                   shape.num_blocks * shape.block_size, shape.max_model_len)

    def store_seconds(self, num_slots: int) -> float:
        """Seconds that writing one block through to the host tier adds to a step (its copy
        out, the worker's work to issue it); 0.0 where no full block fits a probe, and on the
        CPU (its steps are not timed either)."""
        if self.shape.device.type != "cuda":
            return 0.0
        probe = self.time_store(num_slots)
        if probe is None:
            return 0.0
        num_blocks, alone, stored = probe
        return max(stored - alone, 0.0) / num_blocks

    def time_store(self, num_slots: int) -> tuple[int, float, float] | None:
        """(blocks stored, seconds of a prefill of them alone, with their stores), or None
        where no full block fits the pool, the host buffer or a step."""
        size = self.shape.block_size
        num_blocks = min(self._prefill_len() // size, num_slots)  # full blocks, as stored
        if num_blocks < 1:
            return None
        num_tokens = num_blocks * size
        stores = KVTransfers(stores=[(block, block) for block in range(num_blocks)])
        alone = self._timed(lambda: self._prefill_step(num_tokens, None))
        stored = self._timed(lambda: self._prefill_step(num_tokens, None, stores))
        return num_blocks, alone, stored

    def load_rate(self, copy_bytes_per_s: float, num_slots: int, block_bytes: int) -> float:
        """Bytes a second that loading a prefix adds to a step (``block_bytes`` a block, this
        shard's), never above the copy's rate; 0.0 where the pool, the host buffer or the
        token budget holds no probe, and on the CPU (its steps are not timed either)."""
        if self.shape.device.type != "cuda":
            return 0.0
        probe = self.time_load(num_slots)
        if probe is None:
            return 0.0
        num_loaded, _, alone, with_load = probe
        num_bytes = num_loaded * block_bytes
        return num_bytes / max(with_load - alone, num_bytes / copy_bytes_per_s)

    def time_load(self, num_slots: int) -> tuple[int, int, float, float] | None:
        """(blocks loaded, tokens after them, seconds of a step that prefills those tokens
        alone, of one that computes them after the loaded blocks), or None where the pool, the
        host buffer or the token budget holds no probe."""
        shape = self.shape
        size = shape.block_size
        question = min(LOAD_QUESTION_TOKENS, shape.max_num_batched_tokens)
        question_blocks = -(-question // size)
        num_loaded = min(LOAD_PREFIX_TOKENS // size, num_slots,
                         (shape.max_model_len - question) // size,
                         shape.num_blocks - 2 * question_blocks)
        if num_loaded < 1:
            return None
        # the prefix's KV: a prefill into the blocks the load reads back, written to slots
        first = question_blocks
        loaded = list(range(first, first + num_loaded))
        self._run(lambda: self._fill(loaded, num_loaded * size))
        self._run(lambda: self.execute(StepInput([], [], [], transfers=KVTransfers(
            stores=[(block, slot) for slot, block in enumerate(loaded)]))))
        alone = self._timed(lambda: self._prefill_step(question, None))
        with_load = self._timed(lambda: self._prefill_step(
            0, (num_loaded, question, list(range(num_loaded)), first)))
        return num_loaded, question, alone, with_load

    def _fill(self, blocks: list[int], num_tokens: int) -> None:
        """A prefill of ``num_tokens`` into ``blocks``, in chunks the token budget holds."""
        chunk = self.shape.max_num_batched_tokens
        self.execute(StepInput([NewRequest(PREFILL_ID, [0] * num_tokens, num_tokens, blocks,
                                           SamplingSpec(temperature=0.0))], [], []))
        for start in range(0, num_tokens, chunk):
            self.execute(StepInput([], [ScheduledRequest(
                PREFILL_ID, start, min(chunk, num_tokens - start))], []))

    def _prefill_step(self, num_tokens: int, load: tuple[int, int, list[int], int] | None,
                      stores: KVTransfers | None = None) -> None:
        """A prefill of ``num_tokens`` (none: no such row) from block 0 on; with ``load``
        (blocks, new tokens, host slots, first block), a sequence whose prefix of that many
        blocks is loaded from those slots in this step, computing its new tokens after it;
        with ``stores``, the step's copies out after its forward."""
        size = self.shape.block_size
        spec = SamplingSpec(temperature=0.0)
        blocks = list(range(-(-num_tokens // size)))
        new = [NewRequest(PREFILL_ID, [0] * num_tokens, num_tokens, blocks, spec)
               ] if num_tokens else []
        scheduled = [ScheduledRequest(PREFILL_ID, 0, num_tokens)] if num_tokens else []
        transfers = stores
        if load is not None:
            num_loaded, question, slots, first = load
            cached = num_loaded * size
            load_blocks = list(range(first, first + num_loaded + -(-question // size)))
            new.append(NewRequest(LOAD_ID, [0] * (cached + question), cached + question,
                                  load_blocks, spec))
            scheduled.append(ScheduledRequest(LOAD_ID, cached, question))
            transfers = KVTransfers(loads=[BlockLoad(LOAD_ID, slots, load_blocks[:num_loaded],
                                                     in_step=True)])
        self.execute(StepInput(new, scheduled, [], transfers=transfers))

    def _run(self, step: Callable[[], None]) -> float:
        started = time.perf_counter()
        step()
        if self.shape.device.type == "cuda":
            torch.cuda.synchronize(self.shape.device)
        seconds = time.perf_counter() - started
        self.clear()
        return seconds

    def _timed(self, step: Callable[[], None]) -> float:
        """The second of two runs of ``step``, in seconds."""
        self._run(step)
        return max(self._run(step), 1e-9)
