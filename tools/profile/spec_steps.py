"""Where a verify step's time goes (GPU): `python -m tools.profile.spec_steps`.

Runs W5's oracle (``tandem bench speculative``: the draft model's cost paid, the oracle
setting the acceptance) at one batch, alpha and k, to the oracle's fixed point, then once
more with every engine step split into parts, each with its host time and, from CUDA events,
the device's: the draft model's work (``DraftModel.draft_table``: its drafts stay on the device),
the target's verify forward and verify, and the rest of the step (scheduler, outputs). The
host time of a part that ends in a read to the host includes waiting for the device. The
plain engine's decode step (one graph replay of the target at the batch) and the draft's
are timed alone beside them, and cProfile's table of the host's time in a few steps follows.

    python -m tools.profile.spec_steps --shape llama-3.1-8b --draft-shape llama-3.2-1b \
        --batch-sizes 1 --k 4 --alpha 0.8 --output-len 128 --no-hf
"""

import collections
import cProfile
import io
import json
import pstats
import sys
import time

import torch

from cluster.bench.args import add_bench_parsers
from cluster.bench.roofline import median_seconds
from cluster.bench.speculative import (
    Oracle,
    oracle_run,
    plain_runs,
    set_draft_length,
    speculative_engine,
    timed,
)


class PartTimer:
    """Host seconds and device milliseconds (CUDA events) of named parts of each step."""

    def __init__(self) -> None:
        self.host: dict[str, float] = collections.defaultdict(float)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(self, owner, name: str, part: str) -> None:  # type: ignore[no-untyped-def]
        inner = getattr(owner, name)

        def timed_part(*args, **kwargs):  # type: ignore[no-untyped-def]
            began = torch.cuda.Event(enable_timing=True)
            ended = torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            began.record()
            try:
                return inner(*args, **kwargs)
            finally:
                ended.record()
                self.host[part] += time.perf_counter() - start
                self.events.append((part, began, ended))

        setattr(owner, name, timed_part)

    def device_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        totals: dict[str, float] = collections.defaultdict(float)
        for part, began, ended in self.events:
            totals[part] += began.elapsed_time(ended)
        return dict(totals)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.profile.spec_steps")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_bench_parsers(subparsers)
    args = parser.parse_args(["bench", "speculative", *sys.argv[1:]])
    from cluster.bench.commands import Setup

    setup = Setup(args)
    batch, alpha, k = args.batch_sizes[0], args.alpha[0], args.k[0]
    prompts, plain_tokens, plain_s = plain_runs(setup, [batch], args)[batch]
    llm = speculative_engine(setup, args)
    set_draft_length(llm, k)
    timed(llm, prompts, min(32, args.output_len))
    run = oracle_run(llm, prompts, plain_tokens, alpha, setup.vocab_size, args.output_len)
    answers = {tuple(p): t for p, t in zip(prompts, run["tokens"], strict=True)}
    speculator = llm.engine.speculator
    speculator.proposer = Oracle(answers, alpha, setup.vocab_size, draft_model=True)

    worker = llm.engine.executor.worker
    parts = PartTimer()
    parts.wrap(worker.draft, "draft_table", "draft (left on the device)")
    parts.wrap(worker, "_execute_verify", "verify forward + read")
    parts.wrap(llm.engine.executor, "execute", "execute (all of the worker)")
    parts.wrap(llm.engine, "step", "engine step")
    start = time.perf_counter()
    again = timed(llm, prompts, args.output_len)[1]
    wall = time.perf_counter() - start
    steps = sum(1 for part, _, _ in parts.events if part == "engine step")
    device = parts.device_ms()
    report = {"batch": batch, "alpha": alpha, "k": k, "steps": steps,
              "plain_ms_per_token": 1e3 * plain_s / args.output_len,
              "speculative_seconds": again, "wall_s": wall,
              "host_ms_per_step": {p: 1e3 * s / steps for p, s in parts.host.items()},
              "device_ms_per_step": {p: ms / steps for p, ms in device.items()}}
    graphs, draft_graphs = worker.graphs, worker.draft.graphs
    if isinstance(draft_graphs, (tuple, list)):  # an EAGLE head's: (chain step, catch-up)
        draft_graphs = draft_graphs[0]
    for name, owner, size in (("target", graphs, batch), ("target", graphs, batch * (k + 1)),
                              ("draft", draft_graphs, batch)):
        bucket = next((b for b in sorted(owner.graphs) if b >= size), None) if owner else None
        if bucket is not None:
            seconds = median_seconds(owner.graphs[bucket].replay, owner.device, repeats=50)
            report[f"{name}_graph_ms_bucket_{bucket}"] = 1e3 * seconds
    print(json.dumps(report, indent=1))

    host = cProfile.Profile()
    with host:
        timed(llm, prompts, 32)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(35)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
