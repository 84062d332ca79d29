"""What a Ray streaming message costs: one stream per request against one per consumer.

An actor streams 32 requests' deltas, either as 32 streams of one delta a message (one stream
per request) or as one stream of 32 deltas a message (what ``ReplicaActor.subscribe`` does);
the figures are CPU time per delta in the producing actor and in the consuming process.

    python -m tools.profile.ray_streams
"""

import asyncio
import resource
import time

import ray

from cluster.ray.start import init_ray

STREAMS, MESSAGES = 32, 200


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Producer:
    async def stream(self, messages: int, deltas_per_message: int):  # type: ignore[no-untyped-def]
        for i in range(messages):
            yield [("request", [i], "text")] * deltas_per_message

    def cpu(self) -> float:
        return cpu_seconds()


async def consume(producer, streams: int, messages: int, per_message: int) -> int:  # type: ignore[no-untyped-def]
    async def one() -> int:
        count = 0
        refs = producer.stream.options(num_returns="streaming").remote(messages, per_message)
        async for ref in refs:
            count += len(await ref)
        return count

    return sum(await asyncio.gather(*[one() for _ in range(streams)]))


def main() -> None:
    init_ray(include_dashboard=False, ignore_reinit_error=True)
    producer = ray.remote(Producer).remote()
    ray.get(producer.cpu.remote())
    print("| layout | deltas | seconds | producer CPU µs/delta | consumer CPU µs/delta |")
    print("|---|---|---|---|---|")
    for label, streams, messages, per_message in [
            (f"{STREAMS} streams, 1 delta a message", STREAMS, MESSAGES, 1),
            (f"1 stream, {STREAMS} deltas a message", 1, MESSAGES, STREAMS)]:
        consumer0, producer0 = cpu_seconds(), ray.get(producer.cpu.remote())
        start = time.perf_counter()
        deltas = asyncio.run(consume(producer, streams, messages, per_message))
        wall = time.perf_counter() - start
        consumer_us = 1e6 * (cpu_seconds() - consumer0) / deltas
        producer_us = 1e6 * (ray.get(producer.cpu.remote()) - producer0) / deltas
        print(f"| {label} | {deltas} | {wall:.2f} | {producer_us:.0f} | {consumer_us:.0f} |")


if __name__ == "__main__":
    main()
