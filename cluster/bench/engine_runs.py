"""tandem's side of a benchmark: one engine, requests in, timings and counters out."""

import gc
import time
from dataclasses import asdict

import torch

from cluster.bench.roofline import synchronize
from cluster.bench.triton_compiles import CompileLog
from cluster.bench.workloads import Request
from cluster.engine.llm import LLM
from router.sampling_params import SamplingParams


def percentiles(values: list[float]) -> dict:
    """p50, p90, p99 and mean (nearest-rank percentiles)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99),
            "mean": sum(ordered) / len(ordered)}


def make_llm(folder, **engine_args) -> LLM:
    return LLM(model=str(folder), **engine_args)


def release(llm: LLM | None) -> None:
    """Frees an engine's cache, graphs and weights before the next system loads."""
    if llm is not None:
        llm.engine.shutdown()
        llm.engine.executor = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(request: Request) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)


def generate_arriving(llm: LLM, requests: list[Request], arrivals: list[float]) -> list:
    """Each request added to the engine at its arrival (seconds from the start, ascending),
    the engine stepping in between; the outputs in the requests' order. A request's TTFT
    counts from when it was added."""
    engine = llm.engine
    start = time.perf_counter()
    ids: list[str] = []
    done: dict[str, object] = {}
    while len(ids) < len(requests) or len(done) < len(requests):
        now = time.perf_counter() - start
        while len(ids) < len(requests) and arrivals[len(ids)] <= now:
            request = requests[len(ids)]
            ids.append(engine.add_request(request.prompt_token_ids, greedy(request)))
        if engine.has_unfinished():
            for output in engine.step(only_finished=True):
                if output.finished:
                    done[output.request_id] = output
        elif len(ids) < len(requests):  # idle until the next arrival
            time.sleep(max(0.0, arrivals[len(ids)] - (time.perf_counter() - start)))
    return [done[request_id] for request_id in ids]


def run_requests(llm: LLM, requests: list[Request], device: torch.device,
                 compiles: CompileLog | None = None,
                 arrivals: list[float] | None = None) -> dict:
    """Runs every request at once (offline), or each at its arrival (``arrivals``: seconds
    from the start); wall time, token counts, per-request latencies."""
    before = llm.stats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    compiles = compiles or CompileLog()
    compiles_before = len(compiles.seen)
    start = time.perf_counter()
    if arrivals is None:
        outputs = llm.generate([r.prompt_token_ids for r in requests],
                               [greedy(r) for r in requests], use_tqdm=True)
    else:
        outputs = generate_arriving(llm, requests, arrivals)
    synchronize(device)
    seconds = time.perf_counter() - start
    after = llm.stats()
    ttfts, tpots = [], []
    for out in outputs:
        m = out.metrics
        ttfts.append(m.ttft)
        if len(out.token_ids) > 1:
            tpots.append((m.finished_time - m.first_token_time) / (len(out.token_ids) - 1))
    num_output = sum(len(out.token_ids) for out in outputs)
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    cached = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "seconds": seconds, "num_requests": len(requests), "prompt_tokens": num_prompt,
        "output_tokens": num_output, "output_tokens_per_s": num_output / seconds,
        "total_tokens_per_s": (num_prompt + num_output) / seconds,
        "ttft_s": percentiles(ttfts), "tpot_s": percentiles(tpots),
        "prompt_tokens_cached": cached, "prompt_tokens_computed": num_prompt - cached,
        "prefix_cache_queries": queried,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                              if device.type == "cuda" else None),
        "kv_blocks_total": after.kv_blocks_total,
        # kernels compiled inside the timed run (each a stall of up to a second): a warm-up gap
        "triton_compiles": compiles.since(compiles_before),
        "token_ids": [out.token_ids for out in outputs],
        "ttft_each_s": ttfts,  # in the requests' order: a caller's percentiles of a part
    }


def engine_summary(llm: LLM) -> dict:
    worker = getattr(llm.engine.executor, "worker", None)
    graphs = getattr(worker, "graphs", None)
    return {"config": asdict(llm.engine.config),
            "cuda_graph_sizes": graphs.sizes if graphs is not None else []}
