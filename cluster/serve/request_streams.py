"""The cluster interface the HTTP layer needs, and merging several requests' streams into one.

Closing a merged stream closes every stream inside it, so each request is aborted on its
replica and its KV blocks are freed — whether the client left or another prompt failed.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Protocol, TypeVar

from cluster.engine.metrics import MetricsSnapshot
from cluster.engine.outputs import EngineStats, RequestOutput
from router.replica_router import ClusterHealth, RouterStats
from router.sampling_params import SamplingParams

T = TypeVar("T")


class Cluster(Protocol):
    """What the ingress calls; ``TandemCluster`` is the implementation."""

    model_path: Path
    max_model_len: int

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]: ...
    async def abort(self, request_id: str) -> None: ...
    async def health(self) -> ClusterHealth: ...
    async def metrics(self) -> list[MetricsSnapshot]: ...
    async def router_stats(self) -> RouterStats: ...
    async def stats(self) -> list[EngineStats]: ...
    def shutdown(self) -> None: ...


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all streams as they come, tagged with their stream's index."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, None))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, got = await queue.get()
            if got is None:
                remaining -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield index, got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(stream: AsyncIterator[tuple[int, RequestOutput]],
                        count: int) -> list[RequestOutput]:
    """The finished output of each of ``count`` requests."""
    done: dict[int, RequestOutput] = {}
    async with aclosing(stream):  # type: ignore[type-var]
        async for index, output in stream:
            if output.finished:
                done[index] = output
    return [done[index] for index in range(count)]


async def prefetch(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Waits for the first item, so errors before any output raise here, not mid-response."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise

    async def rest() -> AsyncIterator[T]:
        async with aclosing(stream):  # type: ignore[type-var]
            if first is not None:
                yield first
            async for item in stream:
                yield item

    return rest()
