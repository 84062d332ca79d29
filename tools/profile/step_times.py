"""Where an offline run's time goes, step by step: `python -m tools.profile.step_times`.

Runs W2 (or any --shape / --model) through ``LLMEngine.step`` and times every call, split by
kind: calls that prefill (prompt tokens in the batch), single decode steps and multi-step
decode calls; decode calls also by batch size. Each row: calls, seconds, tokens computed,
time per call, and the KV its attention read with the rate over the calls' time
(``kv_tb_per_s``, to set against the decode kernel's own: the gap is everything else a step
runs). The host part of a call is the time outside ``executor.execute`` (scheduler, step
message, outputs). On a GPU, ``gpu_idle_before_s`` is how long the device waited for the
host between the last call and this kind of call (events on the device's clock, see
``idle_before``).
"""

import argparse
import collections
import itertools
import json
import time
from collections.abc import Callable

import torch

from cluster import environment
from cluster.bench.engine_runs import greedy, make_llm
from cluster.bench.shapes import SHAPES, build_random_model
from cluster.bench.triton_compiles import CompileLog
from cluster.bench.workloads import Request, throughput_requests
from workers.kv_cache import kv_bytes_per_block

BATCH_BOUNDS = (8, 16, 32, 64, 128, 192, 256)  # decode calls are also counted by batch size


def batch_bucket(num_seqs: int) -> str:
    return next((f"<= {bound}" for bound in BATCH_BOUNDS if num_seqs <= bound),
                f"> {BATCH_BOUNDS[-1]}")


def idle_before(marks: list[tuple[str, object, object] | None],
                elapsed_ms: Callable[[object, object], float]) -> dict[str, float]:
    """Seconds the device sat idle before each kind of call, summed. ``marks``: per call, in
    order, (kind, an event recorded as the call began, one recorded as it returned), or None
    for a call left out (profiled), which breaks the chain. The
    device passes a call's first event as soon as it has finished what was queued before it,
    so from the previous call's last event to this one's first is how long the device had
    nothing to run: 0 when work was still queued (it passes both at once). A lower bound: the
    call's first kernel comes after the host has built its inputs."""
    idle: dict[str, float] = collections.defaultdict(float)
    for before, mark in itertools.pairwise(marks):
        if before is not None and mark is not None:
            kind, start, _ = mark
            idle[kind] += max(0.0, elapsed_ms(before[2], start)) / 1e3
    return dict(idle)


def context_tokens(step) -> int:
    """Tokens of context the call's attention reads, summed over its rows and steps: step s of
    a row that has computed c tokens attends to c + 1 + s of them (a prefill chunk's tokens
    count once, at its full length: a lower bound of what its attention reads)."""
    steps = step.num_steps
    return sum((item.num_computed_tokens + item.num_new_tokens) * steps
               + steps * (steps - 1) // 2 for item in step.scheduled)


def kv_bytes_per_token(engine) -> int:
    """Bytes of K and V one token holds across the layers (on the in-process worker's shard)."""
    worker = engine.executor.worker
    return kv_bytes_per_block(worker.hf_config, worker.tp.size, 1, worker.dtype, worker.kv_format)


def kind_of(step) -> str:
    if step.new_requests or any(item.num_new_tokens > 1 for item in step.scheduled):
        return "prefill (with decodes)"
    return f"decode x{step.num_steps}"


def profiled(execute, step):
    """One call under torch.profiler (device time by kernel) and cProfile (host time by
    function) at once."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, host:
        result = execute(step)
        torch.cuda.synchronize()
    print(f"-- one {kind_of(step)} call, {len(step.scheduled)} sequences, "
          f"{time.perf_counter() - start:.3f} s under the profilers:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    pstats.Stats(host).sort_stats("cumtime").print_stats(30)
    return result


def trace(llm, requests, profile_kinds: tuple[str, ...] = (), profile_skip: int = 0,
          compiles: CompileLog | None = None) -> dict:
    """Runs the requests one engine step at a time; seconds by kind of step. One call of each
    kind named in ``profile_kinds`` (after ``profile_skip`` of that kind) runs under the
    profiler, and is left out of the figures."""
    engine = llm.engine
    compiles = compiles or CompileLog()
    execute = engine.executor.execute
    last: dict = {}
    to_profile = dict.fromkeys(profile_kinds, profile_skip)
    on_gpu = torch.cuda.is_available()
    # (kind, event at its start, at its return) a call; None for a profiled one
    marks: list[tuple[str, object, object] | None] = []

    def event():
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def timed_execute(step):
        kind = kind_of(step)
        if kind in to_profile:
            to_profile[kind] -= 1
            if to_profile[kind] < 0:
                del to_profile[kind]
                marks.append(None)
                return profiled(execute, step)  # leaves `last` empty: not counted
        start, began = time.perf_counter(), event() if on_gpu else None
        result = execute(step)
        if on_gpu:
            marks.append((kind, began, event()))
        last.update(kind=kind, execute_s=time.perf_counter() - start,
                    tokens=sum(item.num_new_tokens for item in step.scheduled) * step.num_steps,
                    seqs=len(step.scheduled), context_tokens=context_tokens(step))
        return result

    engine.executor.execute = timed_execute
    for request in requests:
        engine.add_request(request.prompt_token_ids, greedy(request))
    kinds: dict[str, dict] = collections.defaultdict(
        lambda: {"calls": 0, "seconds": 0.0, "execute_s": 0.0, "tokens": 0, "seqs": 0,
                 "context_tokens": 0})
    decode_by_batch: dict[str, dict] = collections.defaultdict(
        lambda: {"calls": 0, "seconds": 0.0, "context_tokens": 0})
    start = time.perf_counter()
    while engine.has_unfinished():
        last.clear()
        before, compiles_before = time.perf_counter(), len(compiles.seen)
        engine.step(only_finished=True)
        if not last:
            continue
        kind = kinds[last["kind"]]
        kind["triton_compiles"] = (kind.get("triton_compiles", 0)
                                   + len(compiles.seen) - compiles_before)
        kind["calls"] += 1
        kind["seconds"] += time.perf_counter() - before
        for key in ("execute_s", "tokens", "seqs", "context_tokens"):
            kind[key] += last[key]
        if last["kind"].startswith("decode"):
            by_batch = decode_by_batch[batch_bucket(last["seqs"])]
            by_batch["calls"] += 1
            by_batch["seconds"] += time.perf_counter() - before
            by_batch["context_tokens"] += last["context_tokens"]
    engine.executor.execute = execute
    kv_bytes = kv_bytes_per_token(engine)
    for row in [*kinds.values(), *decode_by_batch.values()]:
        # the K/V the attention read (each step reads every row's context): its rate is how
        # close those calls came to the bandwidth the decode kernel streams at
        row["kv_gb_read"] = row["context_tokens"] * kv_bytes / 1e9
        row["kv_tb_per_s"] = row["kv_gb_read"] / 1e3 / row["seconds"]
    for kind in kinds.values():
        kind["ms_per_call"] = 1e3 * kind["seconds"] / kind["calls"]
        kind["host_ms_per_call"] = 1e3 * (kind["seconds"] - kind["execute_s"]) / kind["calls"]
        kind["mean_batch"] = kind["seqs"] / kind["calls"]
    for by_batch in decode_by_batch.values():
        by_batch["ms_per_call"] = 1e3 * by_batch["seconds"] / by_batch["calls"]
    if on_gpu:
        torch.cuda.synchronize()
        for kind, seconds in idle_before(marks, lambda a, b: a.elapsed_time(b)).items():
            kinds[kind]["gpu_idle_before_s"] = seconds
    return {"seconds": time.perf_counter() - start, "kinds": dict(kinds),
            "decode_calls_by_batch": dict(sorted(decode_by_batch.items(),
                                                 key=lambda item: int(item[0].split()[-1])))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=0)
    parser.add_argument("--input-len", type=int, default=0,
                        help="every prompt this long and every output --output-len (W3's load "
                             "offline: 1,024 / 128); 0: W2's lengths")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="schedule each step while the workers run the one before "
                             "(default: on a GPU)")
    parser.add_argument("--profile-skip", type=int, default=0,
                        help="calls of a profiled kind to let pass before the profiled one")
    parser.add_argument("--profile", nargs="*", default=[], metavar="KIND",
                        help='profile the first call of each kind, e.g. "prefill (with decodes)"')
    args = parser.parse_args()
    compiles = CompileLog.start()
    folder = build_random_model(args.shape, environment.cache_dir() / "bench-models")
    llm = make_llm(folder, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   decode_steps=args.decode_steps, async_scheduling=args.async_scheduling)
    warm = throughput_requests(8, 100, 200)
    trace(llm, warm, compiles=compiles)
    torch.cuda.synchronize()
    warm_up_compiles = len(compiles.seen)
    requests = throughput_requests(args.num_requests)
    if args.input_len:
        requests = [Request((request.prompt_token_ids * args.input_len)[:args.input_len],
                            args.output_len)
                    for request in requests]
    print(json.dumps(trace(llm, requests, tuple(args.profile),
                           args.profile_skip, compiles),
                     indent=1))
    for compile in compiles.seen[warm_up_compiles:]:
        print("compiled after the warm-up:", compile.kernel, compile.key)


if __name__ == "__main__":
    main()
