"""Where the host's time goes in each engine step of a KV tiers run:
`python -m tools.profile.tier_steps <tandem bench prefix arguments>`.

Runs `tandem bench prefix` (recompute beside the host tier, W4-large's arguments) with every
engine step (``LLMEngine._advance``) timed by part on the host's clock: the scheduler, the step
message, the worker's copies before the forward (within them the loads, the set of blocks the
step in flight uses, the index tensors, the compute stream's waits), the forward with sampling,
the write-through after it, the copies' report, the commit. Steps are grouped by what they
ran (loads; else prefill, with prompt tokens; else decode, with stores or without), each group
with its steps, the blocks a step moved, its prompt tokens and the mean milliseconds of each
part, so that what a step with copies costs beyond one without them is read off by part. On a
GPU the parts are host time (launches, Python, and any wait the host makes); ``device`` is the
compute stream's time from the worker's copies to the step's end (two CUDA events), which
equals the host's parts where the device waits for the host's launches, split by two more
events into the compute stream's waits for the step's copies (``device: copies``: in-step loads,
blocks still being stored), its forward and sampling (``device: forward``), and what follows
(``device: stores``: the write-through's launches).
"""

import collections
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cluster.bench import commands, prefix_tiers
from cluster.bench.__main__ import main as bench_main
from cluster.bench.report import markdown_table
from cluster.engine import llm_engine
from cluster.engine.step_builder import StepBuilder
from kvstore.kv_cache_manager import KVCacheManager
from router.scheduler import Scheduler
from workers import kv_offload, worker
from workers.step_timer import prompt_tokens

# (class, method, the part it is counted in), in the order a step runs them
PARTS: list[tuple[type, str, str]] = [
    (Scheduler, "schedule", "schedule"),
    (StepBuilder, "build", "message"),
    (kv_offload.KVOffloader, "before_step", "before forward"),
    (kv_offload.KVOffloader, "_load_all", "loads"),
    (kv_offload.KVOffloader, "_to_device", "index tensors"),
    (kv_offload.KVOffloader, "_wait_for", "waits"),
    (worker.Worker, "_execute", "forward"),
    (kv_offload.KVOffloader, "after_step", "stores"),
    (kv_offload.KVOffloader, "report", "report"),
    (Scheduler, "apply_transfers", "landed"),
    (llm_engine.LLMEngine, "_commit", "commit"),
]
BUSY = "busy blocks"  # kv_offload.blocks_of_requests, as the worker calls it
LOADED, STORED = "blocks loaded", "blocks stored"  # by the step's message, not seconds
PROMPT = "prompt tokens"  # the step's prefill tokens (workers/step_timer.prompt_tokens)
DEVICE = "device"  # the compute stream's time from the worker's copies to its forward's end
# DEVICE in three: up to the end of the copies before the forward, the forward, the rest
DEVICE_PARTS = ("device: copies", "device: forward", "device: stores")
Step = collections.defaultdict[str, float]  # a missing part: 0.0
COLUMNS = ["step", *[part for _, _, part in PARTS[:5]], BUSY,
           *[part for _, _, part in PARTS[5:]], DEVICE, *DEVICE_PARTS]


class StepParts:
    """Each engine step's seconds by part (``steps``: one counter per step, with ``step``,
    its whole time, and ``LOADED`` / ``STORED``: the blocks its message carried)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.current: Step | None = None
        self._undo: list[Callable[[], None]] = []
        # (step, events) CUDA events (start, copies done, forward done, end), read into the
        # step's DEVICE and DEVICE_PARTS once the run is over
        self._device_spans: list[tuple[Step, list[Any]]] = []
        self._marks: list[Any] | None = None  # the step's events so far, while it runs

    def _count(self, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current[part] += time.perf_counter() - start
        return timed

    def _patch(self, owner: Any, name: str, replacement: Callable[..., Any]) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, original))

    def _step(self, advance: Callable[..., Any]) -> Callable[..., Any]:
        def timed_step(engine: Any) -> Any:
            self.current = collections.defaultdict(float)
            start = time.perf_counter()
            try:
                return advance(engine)
            finally:
                self.current["step"] = time.perf_counter() - start
                self.steps.append(self.current)
                self.current = None
        return timed_step

    def _transfers(self, take: Callable[..., Any]) -> Callable[..., Any]:
        def counted(kv: KVCacheManager) -> Any:
            plan = take(kv)
            if plan is not None and self.current is not None:
                self.current[LOADED] += sum(len(load.block_ids) for load in plan.loads)
                self.current[STORED] += len(plan.stores) + len(plan.stores_first)
            return plan
        return counted

    def _on_device(self, execute: Callable[..., Any]) -> Callable[..., Any]:
        """The step's prompt tokens, and its copies and forward timed on the compute stream by
        two CUDA events: whether the device, not the host, is what a step waits for."""
        def timed(worker_: Any, step: Any) -> Any:
            if self.current is not None:
                self.current[PROMPT] += prompt_tokens(step)
            if self.current is None or worker_.device.type != "cuda":
                return execute(worker_, step)
            self._marks = []
            self._mark()
            try:
                return execute(worker_, step)
            finally:
                self._mark()
                if len(self._marks) == 4:  # a step with copies: both offloader calls marked
                    self._device_spans.append((self.current, self._marks))
                self._marks = None
        return timed

    def _mark(self) -> None:
        if self._marks is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)

    def _marked(self, function: Callable[..., Any], after: bool) -> Callable[..., Any]:
        """``function`` with an event on the compute stream after it (else before it)."""
        def marked(*args: Any, **kwargs: Any) -> Any:
            if not after:
                self._mark()
            result = function(*args, **kwargs)
            if after:
                self._mark()
            return result
        return marked

    def read_device_times(self) -> None:
        """Each timed step's device milliseconds, whole and by part, once its events are
        done (seconds, as the other parts)."""
        for step, events in self._device_spans:
            events[-1].synchronize()
            step[DEVICE] = events[0].elapsed_time(events[-1]) / 1e3
            for part, (start, end) in zip(DEVICE_PARTS, itertools.pairwise(events), strict=True):
                step[part] = start.elapsed_time(end) / 1e3
        self._device_spans.clear()

    @contextmanager
    def active(self) -> Iterator["StepParts"]:
        for owner, name, part in PARTS:
            self._patch(owner, name, self._count(part, owner.__dict__[name]))
        self._patch(worker, "blocks_of_requests",
                    self._count(BUSY, kv_offload.blocks_of_requests))
        self._patch(llm_engine.LLMEngine, "_advance",
                    self._step(llm_engine.LLMEngine.__dict__["_advance"]))
        self._patch(KVCacheManager, "take_transfers",
                    self._transfers(KVCacheManager.__dict__["take_transfers"]))
        self._patch(worker.Worker, "_execute_with_copies",
                    self._on_device(worker.Worker.__dict__["_execute_with_copies"]))
        offloader = kv_offload.KVOffloader
        self._patch(offloader, "before_step",
                    self._marked(offloader.__dict__["before_step"], after=True))
        self._patch(offloader, "after_step",
                    self._marked(offloader.__dict__["after_step"], after=False))
        try:
            yield self
        finally:
            while self._undo:
                self._undo.pop()()


def kind_of(step: Step) -> str:
    if step[LOADED]:
        return "loads"
    if step[PROMPT]:
        return "prefill"
    return "decode, stores" if step[STORED] else "decode"


def by_kind(steps: list[Step]) -> dict[str, dict[str, float]]:
    """Per kind of step (and ``all``): steps, blocks moved a step, mean ms of each part."""
    groups: dict[str, list[Step]] = {"all": steps}
    for step in steps:
        groups.setdefault(kind_of(step), []).append(step)
    table = {}
    for kind, group in groups.items():
        n = max(len(group), 1)
        row = {"steps": float(len(group)),
               "blocks a step": sum(s[LOADED] + s[STORED] for s in group) / n,
               PROMPT: sum(s[PROMPT] for s in group) / n}
        row |= {part: sum(s[part] for s in group) / n * 1e3 for part in COLUMNS}
        table[kind] = row
    return table


def run(argv: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """`tandem bench prefix` with ``argv``; each engine's timed run, by kind of step."""
    parts = StepParts()
    runs: dict[str, list[Step]] = {}
    names: list[str] = []
    tier_runs, setup_run = prefix_tiers.tier_runs, commands.Setup.run

    def named_runs(args: Any) -> dict[str, dict[str, Any]]:
        chosen = tier_runs(args)
        names.extend(chosen)
        return chosen

    engines: list[Any] = []  # in the order tier_runs named them

    def timed_run(setup: Any, llm: Any, requests: list[Any], arrivals: Any = None) -> Any:
        if llm not in engines:
            engines.append(llm)
        parts.steps = []
        result = setup_run(setup, llm, requests, arrivals)
        parts.read_device_times()
        runs[names[engines.index(llm)]] = parts.steps  # the warm-up's, then the timed run's
        return result

    prefix_tiers.tier_runs = named_runs
    commands.Setup.run = timed_run  # type: ignore[method-assign,assignment]
    try:
        with parts.active():
            code = bench_main(["prefix", *argv])
    finally:
        prefix_tiers.tier_runs, commands.Setup.run = tier_runs, setup_run  # type: ignore
    if code:
        raise SystemExit(code)
    return {name: by_kind(steps) for name, steps in runs.items()}


def main(argv: list[str] | None = None) -> int:
    tables = run(sys.argv[1:] if argv is None else argv)
    for name, kinds in tables.items():
        rows = [[kind, int(row["steps"]), row["blocks a step"], row[PROMPT],
                 *(row[c] for c in COLUMNS)] for kind, row in kinds.items()]
        print(f"\n{name}: host ms a step, by part (device: the compute stream's ms)\n")
        print(markdown_table(["steps of", "steps", "blocks a step", PROMPT, *COLUMNS], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
