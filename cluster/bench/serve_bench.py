"""`tandem bench serve` — W3, online serving: the same load through the HTTP API and in-process.

A load is fixed concurrency (C requests always in flight) or Poisson arrivals (rate r/s).
Each request streams; we time the first token (TTFT), every later chunk (ITL), the end
(e2e), and TPOT = (e2e - TTFT) / (output tokens - 1). Goodput counts requests per second
that meet TTFT < 200 ms and TPOT < 20 ms. The in-process run drives ``TandemCluster``
directly, the HTTP run goes through Ray Serve and the OpenAI API: their ratio is the cost of
serving.
"""

import argparse
import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cluster import environment

SLO_TTFT_S, SLO_TPOT_S = 0.200, 0.020


@dataclass
class Timing:
    start: float
    chunk_times: list[float] = field(default_factory=list)  # when output arrived
    end: float = 0.0
    output_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


Send = Callable[[list[int], int], Awaitable[Timing]]


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None  # fixed concurrency, or
    rate: float | None = None  # Poisson arrivals per second

    @property
    def name(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency else f"{self.rate:g} req/s"


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # distinct random prompts: no accidental prefix hits
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


async def run_load(send: Send, prompts: list[list[int]], output_len: int, load: Load,
                   seed: int) -> tuple[list[Timing], float]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(load.concurrency or len(prompts))

    async def one(prompt: list[int]) -> Timing:
        async with gate:
            return await send(prompt, output_len)

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if load.rate:
            await asyncio.sleep(rng.expovariate(load.rate))
    timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - start


def summarize(timings: list[Timing], seconds: float) -> dict:
    from cluster.bench.engine_runs import percentiles

    tpots = [t.tpot for t in timings if t.tpot is not None]
    good = [t for t in timings if t.ttft < SLO_TTFT_S and (t.tpot or 0.0) < SLO_TPOT_S]
    output_tokens = sum(t.output_tokens for t in timings)
    return {
        "requests": len(timings), "seconds": seconds, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds, "requests_per_s": len(timings) / seconds,
        "goodput_requests_per_s": len(good) / seconds,
        "ttft_s": percentiles([t.ttft for t in timings]), "tpot_s": percentiles(tpots),
        "itl_s": percentiles([x for t in timings for x in t.itls]),
        "e2e_s": percentiles([t.end - t.start for t in timings]),
    }


# -- the two ways in ----------------------------------------------------------------------------


def in_process_sender(cluster) -> Send:  # type: ignore[no-untyped-def]
    from router.sampling_params import SamplingParams

    counter = iter(range(1 << 62))

    async def send(prompt: list[int], output_len: int) -> Timing:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        timing, seen = Timing(time.perf_counter()), 0
        async for out in cluster.generate(prompt, params, f"bench-{next(counter)}"):
            if len(out.token_ids) > seen:
                timing.chunk_times.append(time.perf_counter())
                seen = len(out.token_ids)
        timing.end, timing.output_tokens = time.perf_counter(), seen
        return timing

    return send


def http_sender(client, model: str) -> Send:  # type: ignore[no-untyped-def]
    """Streams /v1/completions. The client must cost little per chunk, or the benchmark
    measures itself: events are split from the raw bytes, and only the rare ones that can end
    a choice or carry the usage are parsed as JSON."""

    async def send(prompt: list[int], output_len: int) -> Timing:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        timing, pending = Timing(time.perf_counter()), b""
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for data in response.aiter_raw():
                now = time.perf_counter()
                *events, pending = (pending + data).split(b"\n\n")
                for item in events:
                    read_event(item, now, timing)
        timing.end = time.perf_counter()
        return timing

    return send


def read_event(item: bytes, now: float, timing: Timing) -> None:
    """One SSE event of a completion stream: a chunk with output marks a chunk time."""
    if not item.startswith(b"data: {"):
        return  # [DONE], comments, keep-alives
    if b'"finish_reason"' not in item and b'"usage"' not in item:
        timing.chunk_times.append(now)  # an ordinary chunk of text (None fields are left out)
        return
    chunk = json.loads(item[6:])
    choice = (chunk.get("choices") or [{}])[0]
    if choice.get("text"):
        timing.chunk_times.append(now)
    if chunk.get("usage"):
        timing.output_tokens = chunk["usage"]["completion_tokens"]


async def run_loads(send: Send, args: argparse.Namespace, loads: list[Load],
                    vocab: int) -> dict[str, dict]:
    results = {}
    for index, load in enumerate(loads):
        # a short run of the same load first: the batch shapes it reaches (prefill chunks mixed
        # with decodes, graph buckets) meet their Triton compiles and cuBLAS setup there, not
        # in the measured run — which would otherwise penalize whichever path runs first
        warm = make_prompts(load.concurrency or 8, args.input_len, vocab, seed=-1 - index)
        await run_load(send, warm, min(16, args.output_len), load, args.seed)
        count = args.num_requests or max(8 * (load.concurrency or 8), 32)
        prompts = make_prompts(count, args.input_len, vocab, seed=args.seed + index)
        timings, seconds = await run_load(send, prompts, args.output_len, load, args.seed)
        results[load.name] = summarize(timings, seconds)
        print(f"  {load.name}: {results[load.name]['output_tokens_per_s']:.1f} output tok/s")
    return results


# -- the command --------------------------------------------------------------------------------


def add_serve_bench_parser(workloads: argparse._SubParsersAction) -> None:
    parser = workloads.add_parser("serve", help="W3: online serving, HTTP vs in-process")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default="smollm2-135m-instruct",
                       help="catalog name or HF folder (default: %(default)s)")
    model.add_argument("--shape", help="a real architecture with random weights "
                       "(see `tandem bench latency --help`)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--ingress-replicas", type=int, default=0,
                        help="HTTP ingress replicas in front of the same engines (default: 0, "
                        "auto: 4 on a GPU, 1 on the CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument("--decode-lookahead", action="store_true",
                        help="multi-step calls also run the next call's first step")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32,128",
                        help="comma-separated fixed concurrencies ('' for none)")
    parser.add_argument("--request-rate", default="",
                        help="comma-separated Poisson arrival rates in requests/s")
    parser.add_argument("--num-requests", type=int, default=0,
                        help="per load (default: 8 x concurrency, at least 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="JSON path (default: bench-results/serve-<time>.json)")
    parser.set_defaults(handler=serve_bench)


def parse_loads(args: argparse.Namespace) -> list[Load]:
    loads = [Load(concurrency=int(c)) for c in args.concurrency.split(",") if c.strip()]
    loads += [Load(rate=float(r)) for r in args.request_rate.split(",") if r.strip()]
    if not loads or any((lo.concurrency or 1) < 1 or (lo.rate or 1) <= 0 for lo in loads):
        raise ValueError("give at least one --concurrency >= 1 or --request-rate > 0")
    return loads


def serve_bench(args: argparse.Namespace) -> int:
    loads = parse_loads(args)
    # as `tandem serve` runs it (the Ray instance below starts with this environment)
    environment.set_serve_throughput_optimized(None)
    return asyncio.run(_serve_bench(args, loads))


async def _serve_bench(args: argparse.Namespace, loads: list[Load]) -> int:
    import socket

    try:  # the openai client of this venv brings httpx2; elsewhere plain httpx is there
        import httpx2 as httpx
    except ImportError:
        import httpx
    import ray
    from ray import serve

    from cluster.bench.report import machine_facts, publish
    from cluster.ray.tandem_cluster import TandemCluster
    from cluster.serve.app import server_app
    from cluster.serve.config import load_config
    from workers.loader import load_config as load_hf_config

    if args.shape:
        from cluster.bench.shapes import build_random_model
        args.model = str(build_random_model(args.shape, environment.cache_dir() / "bench-models"))
    config = load_config({
        "model": args.model, "dtype": args.dtype, "device": args.device,
        "tensor_parallel_size": args.tp, "num_replicas": args.replicas,
        "ingress_replicas": args.ingress_replicas,
        "max_num_seqs": args.max_num_seqs, "num_kv_blocks": args.num_kv_blocks,
        "max_model_len": args.input_len + args.output_len + 16, "api_key": None,
        "decode_lookahead": args.decode_lookahead,
    })
    ray.init(include_dashboard=False, ignore_reinit_error=True)
    print("in-process: TandemCluster.generate, no HTTP")
    cluster = await asyncio.to_thread(TandemCluster, config.engine_config(), config.num_replicas)
    vocab = min(load_hf_config(cluster.model_path).vocab_size, 10000)
    in_process = await run_loads(in_process_sender(cluster), args, loads, vocab)
    await asyncio.to_thread(cluster.shutdown)

    print("http: Ray Serve, OpenAI /v1/completions, streaming")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    await asyncio.to_thread(serve.run, server_app(config), name="bench", route_prefix="/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None,
                                 limits=limits) as client:
        http = await run_loads(http_sender(client, config.model_name), args, loads, vocab)
    record = {"workload": "serve", "config": vars(args) | {"handler": None},
              "environment": machine_facts(_device(config.engine_config().resolved_device)),
              "in_process": in_process, "http": http}
    published = publish(record, table(loads, in_process, http), args.output)
    serve.shutdown()  # after the figures are out: it can take Serve tens of seconds
    return 0 if published else 1


def _device(name: str):  # type: ignore[no-untyped-def]
    import torch

    return torch.device(name)


def table(loads: list[Load], in_process: dict, http: dict) -> str:
    from cluster.bench.report import markdown_table

    header = ["load", "path", "out tok/s", "HTTP / in-proc", "TTFT p50/p99 ms",
              "TPOT p50/p99 ms", "ITL p50/p99 ms", "e2e p50/p99 s", "goodput req/s"]

    def ms(stats: dict) -> str:
        return "—" if stats["p50"] is None else f"{stats['p50']*1e3:.1f} / {stats['p99']*1e3:.1f}"

    rows = []
    for load in loads:
        base = in_process[load.name]["output_tokens_per_s"]
        for path, results in (("in-process", in_process), ("http", http)):
            r = results[load.name]
            rows.append([load.name, path, r["output_tokens_per_s"],
                         f"{r['output_tokens_per_s'] / base:.1%}" if path == "http" else "",
                         ms(r["ttft_s"]), ms(r["tpot_s"]), ms(r["itl_s"]),
                         f"{r['e2e_s']['p50']:.2f} / {r['e2e_s']['p99']:.2f}",
                         r["goodput_requests_per_s"]])
    return markdown_table(header, rows)
