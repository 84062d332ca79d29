"""A process's stream from one replica, carrying all of its requests' deltas.

``ReplicaActor.subscribe`` sends every step's deltas for a consumer's requests as one Ray
message; here they are handed to a queue per request, which ``TandemCluster.generate`` reads.
If the stream breaks (the replica actor died), every request waiting on it gets the error,
and the next request opens a new stream.
"""

import asyncio
import uuid

import ray

from cluster.engine.outputs import RequestDelta

Item = RequestDelta | BaseException


class StreamClosed(RuntimeError):
    """The replica's stream ended though requests were still on it: its actor is gone."""


class ReplicaStream:
    def __init__(self, replica) -> None:  # type: ignore[no-untyped-def]
        self.consumer_id = uuid.uuid4().hex  # one per stream: a stream is never shared
        self.queues: dict[str, asyncio.Queue[Item]] = {}
        self.broken = False
        self.loop = asyncio.get_running_loop()
        self._refs = replica.subscribe.options(num_returns="streaming").remote(self.consumer_id)
        self._task = self.loop.create_task(self._pump())

    def open(self, request_id: str) -> asyncio.Queue[Item]:
        """The queue the request's deltas (or the error that ends it) will arrive in."""
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self.queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def _pump(self) -> None:
        error: BaseException = StreamClosed("the replica closed its stream")
        try:
            async for ref in self._refs:
                for request_id, item in await ref:
                    queue = self.queues.get(request_id)
                    if queue is not None:  # else the caller left: its abort is on the way
                        queue.put_nowait(item)
        except asyncio.CancelledError:
            ray.cancel(self._refs)  # the replica then aborts this stream's requests
            raise
        except Exception as exc:  # the replica actor is gone, or its stream failed
            error = exc
        self.broken = True
        for queue in self.queues.values():
            queue.put_nowait(error)

    def usable(self) -> bool:
        """Whether new requests may use it: still pumping, on the running event loop."""
        return (not self.broken and not self._task.done()
                and self.loop is asyncio.get_running_loop())
