"""The HTTP side of `tandem bench serve`, sent from several client processes.

One Python process streaming a few hundred SSE responses spends ~50 µs of its core on each
chunk it reads (httpx, h11, the event loop): at ten thousand tokens a second it is the
bottleneck, it sends new requests late, and the benchmark measures itself. Here each load is
split over ``processes`` client processes, each with its own event loop and connections, each
to one of the server's HTTP ports in turn (direct ingress: one port an ingress replica). A
process takes every P-th prompt, its share of the concurrency cap, and 1/P of the arrival
rate (P Poisson streams of rate r/P are one of rate r). Chunk times are ``perf_counter``
stamps, one clock for every process of the machine.
"""

import asyncio
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from cluster.bench.serve_load import Load, Timing, http_sender, run_load


def httpx_module():  # type: ignore[no-untyped-def]
    try:  # the openai client of this venv brings httpx2; elsewhere plain httpx is there
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


class ClientError(RuntimeError):
    """An HTTP error in a client process, as one line (httpx's errors do not all pickle)."""


def split_load(load: Load, processes: int) -> list[Load]:
    """Each process's part of ``load``: the cap shared out (no process without one), the
    rate divided among those that run."""
    if load.concurrency is not None:
        count = min(processes, load.concurrency)
        caps: list[int | None] = [load.concurrency // count + (i < load.concurrency % count)
                                  for i in range(count)]
    else:
        count, caps = processes, [None] * processes
    rate = load.rate / count if load.paced else load.rate  # type: ignore[operator]
    return [replace(load, concurrency=cap, rate=rate) for cap in caps]


def run_part(base_url: str, headers: dict[str, str], model: str, prompts: list[list[int]],
             output_len: int, load: Load, seed: int) -> tuple[float, list[Timing]]:
    """In a client process: one part of a load, with its own connections."""
    return asyncio.run(_run_part(base_url, headers, model, prompts, output_len, load, seed))


async def _run_part(base_url: str, headers: dict[str, str], model: str,
                    prompts: list[list[int]], output_len: int, load: Load,
                    seed: int) -> tuple[float, list[Timing]]:
    httpx = httpx_module()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    try:
        # no read timeout (a long generation is no fault), but a host that never answers is one
        async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(None, connect=10.0)) as client:
            start = time.perf_counter()
            timings, _ = await run_load(http_sender(client, model), prompts, output_len, load,
                                        seed)
    except httpx.HTTPError as error:
        lines = str(error).splitlines()
        raise ClientError(lines[0] if lines else type(error).__name__) from None
    return start, timings


def started() -> int:
    """A client process's first task: it is up, its imports done (a pause long enough that
    the pool starts a process for each of these, rather than reuse one that is done)."""
    httpx_module()
    time.sleep(0.2)
    return os.getpid()


class HttpClients:
    """A pool of client processes, every one started before the first load: the pool starts
    them on demand, one a task submitted while none is idle, so a load split over P processes
    would otherwise run on fewer, parts one after another, while the rest are still starting
    (W3 at concurrency 32 once measured 40% of in-process for it)."""

    def __init__(self, base_urls: list[str], model: str, processes: int,
                 headers: dict[str, str] | None = None) -> None:
        self.base_urls, self.model, self.processes = base_urls, model, processes
        self.headers = headers or {}
        self.pool = ProcessPoolExecutor(processes,
                                        mp_context=multiprocessing.get_context("spawn"))
        self.pids = {future.result() for future in
                     [self.pool.submit(started) for _ in range(processes)]}

    async def run(self, prompts: list[list[int]], output_len: int, load: Load,
                  seed: int) -> tuple[list[Timing], float]:
        """What ``run_load`` returns: every request's timing, and the load's wall time."""
        loop = asyncio.get_running_loop()
        parts = split_load(load, self.processes)
        futures = [loop.run_in_executor(
            self.pool, run_part, self.base_urls[i % len(self.base_urls)], self.headers,
            self.model, prompts[i::len(parts)], output_len, part, seed + i)
            for i, part in enumerate(parts)]
        results = await asyncio.gather(*futures)
        timings = [t for _, part_timings in results for t in part_timings]
        start = min(start for start, _ in results)
        return timings, max(t.end for t in timings) - start

    def close(self) -> None:
        self.pool.shutdown()
