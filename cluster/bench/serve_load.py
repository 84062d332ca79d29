"""W3's load: requests sent at a fixed concurrency, at Poisson arrivals or both, through a
sender (in-process ``TandemCluster.generate`` or streamed HTTP), each one timed: the first
token (TTFT), every later chunk (ITL), the end (e2e), TPOT = (e2e - TTFT) / (output - 1)."""

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cluster.bench.slo import DEFAULT_GOODPUT, Slo, goodput, parse_slo
from cluster.bench.timing import Timing
from cluster.bench.vllm_results import traffic_keys, vllm_metrics

# Random prompt token ids stay below this: every real vocabulary is bigger, so the prompts are
# valid for a server whose model we don't know (--base-url); locally, min(vocab, this).
SAFE_VOCAB = 10000


Send = Callable[[list[int], int], Awaitable[Timing]]
# (prompts, output_len, load, seed) -> every request's timing and the load's seconds: run_load
# over one Send, or several client processes (http_clients.py)
Runner = Callable[[list[list[int]], int, "Load", int], Awaitable[tuple[list[Timing], float]]]


@dataclass(frozen=True)
class Load:
    """Fixed concurrency, Poisson arrivals, or arrivals capped at a concurrency."""

    concurrency: int | None = None  # requests in flight at most (None: no cap)
    rate: float | None = None  # Poisson arrivals per second (None or inf: all at once)

    @property
    def name(self) -> str:
        parts = [f"{self.rate:g} req/s"] if self.rate else []
        return ", ".join(parts + ([f"concurrency {self.concurrency}"] if self.concurrency else []))

    @property
    def valid(self) -> bool:
        return ((self.concurrency is None or self.concurrency >= 1)
                and (self.rate is None or self.rate > 0))

    @property
    def paced(self) -> bool:
        return self.rate is not None and math.isfinite(self.rate)


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
        if load.paced:
            await asyncio.sleep(rng.expovariate(load.rate))
    timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - start


def goodput_slo(args: argparse.Namespace) -> Slo:
    """--goodput's limits (vLLM's spelling), 200 ms TTFT and 20 ms TPOT when not given."""
    return parse_slo(getattr(args, "goodput", None) or DEFAULT_GOODPUT, "--goodput")


def summarize(timings: list[Timing], seconds: float, input_lens: list[int], load: Load,
              slo: Slo) -> dict:
    """vLLM's keys (cluster/bench/vllm_results.py), and beside them tandem's own."""
    return (vllm_metrics(timings, seconds, input_lens)
            | traffic_keys(load.concurrency, load.rate) | tandem_summary(timings, seconds, slo))


def tandem_summary(timings: list[Timing], seconds: float, slo: Slo) -> dict:
    """Nearest-rank percentiles in seconds, and goodput at ``slo`` (vLLM's
    ``request_goodput`` too)."""
    from cluster.bench.engine_runs import percentiles

    finished = [t for t in timings if t.chunk_times]
    tpots = [t.tpot for t in finished if t.tpot is not None]
    output_tokens = sum(t.output_tokens for t in timings)
    good = goodput(timings, seconds, slo)
    return {
        "requests": len(timings), "finished": len(finished), "seconds": seconds,
        "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / seconds,
        "requests_per_s": len(timings) / seconds,
        "goodput_requests_per_s": good, "request_goodput": good, "goodput_slo": slo.text,
        "ttft_s": percentiles([t.ttft for t in finished]), "tpot_s": percentiles(tpots),
        "itl_s": percentiles([x for t in finished for x in t.itls]),
        "e2e_s": percentiles([t.end - t.start for t in finished]),
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


def num_prompts(load: Load, asked: int) -> int:
    """--num-prompts, else 8 x the concurrency, or 8 s of arrivals at an uncapped finite rate,
    and at least 32."""
    if asked:
        return asked
    if load.concurrency is None and load.paced:
        return max(round(8 * load.rate), 32)  # type: ignore[operator]
    return max(8 * (load.concurrency or 8), 32)


def runner_of(send: Send) -> Runner:
    """A load runner over one sender in this process."""

    async def run(prompts: list[list[int]], output_len: int, load: Load,
                  seed: int) -> tuple[list[Timing], float]:
        return await run_load(send, prompts, output_len, load, seed)

    return run


async def run_loads(send: Send | None, args: argparse.Namespace, loads: list[Load],
                    vocab: int, runner: Runner | None = None) -> dict[str, dict]:
    """Each load warmed up, then measured; ``runner`` (if given) runs them instead of one
    ``send`` in this process. Beside each load's figures, the cores each process used and
    how busy each GPU was (``gpu_busy``, where nvidia-smi runs)."""
    from cluster.bench.gpu_meter import GpuMeter
    from cluster.bench.process_cpu import CpuMeter

    if runner is None:
        assert send is not None
        runner = runner_of(send)
    results = {}
    for index, load in enumerate(loads):
        # a short run of the same load first: the batch shapes it reaches (prefill chunks mixed
        # with decodes, graph buckets) meet their Triton compiles and cuBLAS setup there, not
        # in the measured run — which would otherwise penalize whichever path runs first
        warm = make_prompts(load.concurrency or 8, args.input_len, vocab, seed=-1 - index)
        await runner(warm, min(16, args.output_len), load, args.seed)
        count = num_prompts(load, args.num_requests)
        prompts = make_prompts(count, args.input_len, vocab, seed=args.seed + index)
        meter, gpus = CpuMeter(), GpuMeter()
        timings, seconds = await runner(prompts, args.output_len, load, args.seed)
        result = summarize(timings, seconds, [len(p) for p in prompts], load, goodput_slo(args))
        cores, busy = meter.shares(), gpus.busy()
        results[load.name] = result | {"cpu_cores": cores} | (
            {} if busy is None else {"gpu_busy": busy})
        busiest = ", ".join(f"{name} {share:.2f}" for name, share in list(cores.items())[:6])
        devices = "" if not busy else "; GPUs busy " + ", ".join(
            f"{gpu}: {share:.0%}" for gpu, share in busy.items())
        print(f"  {load.name}: {result['output_tokens_per_s']:.1f} output tok/s "
              f"(cores: {busiest}{devices})")
    return results
