"""Mid-stream failover: a request whose replica is lost continues on another, in one stream.

An attempt is one placement of the request on one replica (``TandemCluster._attempt``). When
the replica is lost under it — its engine failed (``ReplicaFailure``: a shard died, the replica
rebuilds) or its process died (Ray's actor errors, or its stream ended) — the attempt raises
``ReplicaLost`` and the next one starts from the output the caller already has: the prompt
plus the tokens already sent, which the engine resumes as a preempted sequence (resume.py), so
greedy and seeded requests continue with exactly the tokens they would have had. The caller
sees one unbroken stream of outputs: the continuation's only add to what it has.

A continuation first avoids the replicas this request lost; when every replica has been lost
under it, it goes back to one and waits for its rebuild or restart (``ReplicaActor.submit``
waits for a rebuild). If none takes it within ``failover_timeout_s`` of the first loss, the
request ends with ``NoReplicaAvailable`` (a 503 with Retry-After), never with Ray's error.
"""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

import ray

from cluster.engine.outputs import OutputAccumulator, RequestOutput
from cluster.engine.resume import Resume
from cluster.ray.refusals import NoReplicaAvailable
from cluster.ray.replica import ReplicaFailure
from cluster.ray.replica_streams import StreamClosed
from cluster.ray.serving_policy import ServingPolicy

log = logging.getLogger(__name__)

# the pause before the n-th continuation: none before the first (another replica is likely up),
# then longer ones while every replica is down, so a restart is not hammered
BACKOFF_S = (0.0, 0.25, 0.5, 1.0, 2.0)

# attempt(resume, lost replicas) -> the outputs of one placement
Attempt = Callable[[Resume | None, frozenset[int]], AsyncGenerator[RequestOutput, None]]


class ReplicaLost(Exception):
    def __init__(self, replica: int, cause: BaseException, process_died: bool) -> None:
        super().__init__(f"replica {replica} was lost: {type(cause).__name__}")
        self.replica, self.cause, self.process_died = replica, cause, process_died


def process_died(error: BaseException) -> bool | None:
    """Whether ``error`` from a replica means it was lost: True when its process died (or
    Ray is restarting it), False when its engine failed and it rebuilds; None when the error
    is the request's own (bad input, a request the engine failed alone)."""
    if isinstance(error, ray.exceptions.RayActorError | StreamClosed):
        return True
    if isinstance(error, ReplicaFailure):  # also when it crossed Ray inside a RayTaskError
        return False
    return None


async def with_failover(request_id: str, attempt: Attempt, accumulator: OutputAccumulator,
                        policy: ServingPolicy) -> AsyncIterator[RequestOutput]:
    """The outputs of ``attempt``, continued after each loss until the request finishes."""
    arrived = time.monotonic()
    lost: set[int] = set()
    losses = 0
    first_loss: float | None = None
    while True:
        sent = accumulator.output
        resume = None if sent is None else Resume.from_output(sent, time.monotonic() - arrived)
        try:
            # closed here, not when collected: closing this stream aborts the request at once
            async with aclosing(attempt(resume, frozenset(lost))) as outputs:
                async for output in outputs:
                    yield output
            return
        except ReplicaLost as loss:
            now = time.monotonic()
            first_loss = now if first_loss is None else first_loss
            waited = now - first_loss
            tokens = 0 if accumulator.output is None else len(accumulator.output.token_ids)
            if waited >= policy.failover_timeout_s:
                log.error("request %s: no replica took it within %.0f s of losing one",
                          request_id, policy.failover_timeout_s)
                raise NoReplicaAvailable(
                    "The engine replica running this request was lost and no other could take "
                    "it over: retry the request.", policy.retry_after_s) from loss.cause
            log.warning("request %s: %s; continuing it on another replica after %d tokens",
                        request_id, loss, tokens)
            lost.add(loss.replica)
            losses += 1
            pause = BACKOFF_S[min(losses - 1, len(BACKOFF_S) - 1)]
            await asyncio.sleep(min(pause, policy.failover_timeout_s - waited))
