"""`tandem bench prefix --replicas N --routing ...`: W4 over N engine replicas on Ray.

Each routing policy gets a fresh ``TandemCluster`` (replicas on their share of the GPUs: with
one GPU and two replicas, each asks Ray for half of it and takes half of its memory) and the
same requests, submitted at once from this process or as Poisson arrivals at
``--request-rate`` (seeded: every policy sees the same arrival times). Prompt tokens computed
are set against the single-replica ideal (each group's prefix computed once in the cluster).
"""

import argparse
import asyncio
import time
from dataclasses import asdict

from cluster.bench.engine_runs import greedy, percentiles
from cluster.bench.report import markdown_table
from cluster.bench.workloads import Request, arrival_times
from cluster.engine.config import EngineConfig
from cluster.ray.start import init_ray


def engine_config(args: argparse.Namespace, folder: str, dtype: str, device: str) -> EngineConfig:
    share = 1.0 / args.replicas if device.startswith("cuda") else 1.0
    return EngineConfig(
        model=folder, dtype=dtype, device=device, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager, decode_steps=args.decode_steps,
        decode_lookahead=args.decode_lookahead, cpu_kv_cache_gb=args.cpu_kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization * share, gpu_fraction=share,
        attention_backend=args.attention_backend, seed=args.seed,
        num_kv_blocks=args.num_kv_blocks, kv_cache_dtype=args.kv_cache_dtype,
    )


async def run_all(cluster, requests: list[Request], tag: str, rate: float = 0.0,
                  seed: int = 0) -> dict:
    """The requests at their arrival times; per request its TTFT and tokens; the cluster's
    prefix hits."""
    hits_before = sum(s.prefix_cache_hits for s in await cluster.stats())
    arrivals = arrival_times(len(requests), rate, seed)
    start = time.perf_counter()

    async def one(index: int, request: Request) -> tuple[float, float, int]:
        await asyncio.sleep(max(0.0, start + arrivals[index] - time.perf_counter()))
        sent, first, tokens = time.perf_counter(), None, 0
        async for output in cluster.generate(request.prompt_token_ids, greedy(request),
                                             f"{tag}-{index}"):
            tokens = len(output.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter()
        assert first is not None
        return first - sent, time.perf_counter() - sent, tokens

    done = await asyncio.gather(*[one(i, r) for i, r in enumerate(requests)])
    seconds = time.perf_counter() - start
    hits = sum(s.prefix_cache_hits for s in await cluster.stats()) - hits_before
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(tokens for _, _, tokens in done)
    return {"seconds": seconds, "prompt_tokens": prompt, "prompt_tokens_cached": hits,
            "prompt_tokens_computed": prompt - hits, "output_tokens": output,
            "output_tokens_per_s": output / seconds,
            "ttft_s": percentiles([ttft for ttft, _, _ in done]),
            "e2e_s": percentiles([e2e for _, e2e, _ in done])}


def prefix_replicas(args: argparse.Namespace, config: EngineConfig, requests: list[Request],
                    warmup: list[Request], ideal_computed: float) -> tuple[dict, str]:
    import ray

    from cluster.ray.tandem_cluster import TandemCluster

    if not ray.is_initialized():
        init_ray(include_dashboard=False, log_to_driver=False)
    results = {}
    for routing in args.routing.split(","):
        print(f"{args.replicas} replicas, routing {routing} ...", flush=True)
        cluster = TandemCluster(config, num_replicas=args.replicas, routing=routing)
        try:
            asyncio.run(run_all(cluster, warmup, f"warm-{routing}"))
            run = asyncio.run(run_all(cluster, requests, routing, args.request_rate, args.seed))
            run["router"] = asdict(asyncio.run(cluster.router_stats()))
            results[routing] = run
        finally:
            cluster.shutdown()
    rows = [[routing, r["prompt_tokens_computed"], r["prompt_tokens_computed"] / ideal_computed,
             r["ttft_s"]["p50"] * 1e3, r["ttft_s"]["p99"] * 1e3, r["output_tokens_per_s"],
             r["seconds"], ", ".join(f"{k} {v}" for k, v in sorted(
                 r["router"]["decisions"].items()))]
            for routing, r in results.items()]
    load = f", {args.request_rate:g} req/s" if args.request_rate > 0 else ", all at once"
    table = markdown_table([f"W4, {args.replicas} replicas{load}", "prompt tokens computed",
                            "/ 1-replica ideal", "TTFT p50 ms", "TTFT p99 ms", "output tok/s",
                            "seconds", "decisions"], rows)
    return results, table
