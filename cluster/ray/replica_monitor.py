"""The cluster's active health check: every period, each replica and its shards are pinged.

A replica whose process died, or whose engine is rebuilding, or one of whose shards no longer
answers, is reported down to the router (which then places nothing there and says so on
/health); it is reported up again once it answers whole. A dead shard found this way makes its
replica rebuild at once, so a fault on an idle replica is found within a period, not by the
next request that fails. Which replica and why goes to this actor's log, when it changes.

Each ping also brings the replica's metrics, which the ledger keeps across the replica's
processes (metrics_ledger.py); /metrics reads them here.

Ray restarts this actor if it dies, with the same replica and router handles: it then goes on
checking, and its ledger starts again from the replicas' own counts.
"""

import asyncio
import logging

from cluster.engine.metrics import MetricsSnapshot
from cluster.ray.metrics_ledger import MetricsLedger

log = logging.getLogger(__name__)

MONITOR_ACTOR_OPTIONS = {"max_restarts": -1, "num_cpus": 0}


class ReplicaMonitor:
    def __init__(self, replicas: list, router: object, period_s: float,
                 timeout_s: float) -> None:
        self.replicas, self.router = replicas, router
        self.period_s, self.timeout_s = period_s, timeout_s
        self.ledger = MetricsLedger(len(replicas))
        self.problems: list[str | None] = [None] * len(replicas)
        self.task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # the router restarting, say: the next round tells it again
                log.exception("a health-check round failed")
            await asyncio.sleep(self.period_s)

    async def check(self) -> list[bool]:
        """One round: pings every replica, records what changed, tells the router; whether
        each replica is up."""
        problems = await asyncio.gather(*[self._ping(index) for index in range(len(
            self.replicas))])
        for index, (before, now) in enumerate(zip(self.problems, problems, strict=True)):
            if now is not None and before is None:
                log.warning("replica %d is down: %s", index, now)
            elif now is None and before is not None:
                log.warning("replica %d is up again", index)
        self.problems = problems
        alive = [problem is None for problem in problems]
        await self.router.set_health.remote(alive)  # type: ignore[attr-defined]
        return alive

    async def set_replicas(self, replicas: list) -> None:
        """The owner's list after its autoscaler added a replica or removed one (None)."""
        from cluster.ray.metrics_ledger import ReplicaLedger

        self.ledger.replicas += [ReplicaLedger() for _ in range(len(replicas)
                                                                 - len(self.ledger.replicas))]
        self.problems += [None] * (len(replicas) - len(self.problems))
        self.replicas = list(replicas)

    async def _ping(self, index: int) -> str | None:
        """None when the replica answered whole (or was removed); else what is wrong."""
        if self.replicas[index] is None:  # removed by the autoscaler: nothing to watch
            return None
        try:
            # half the time for its shards' answers, so its own answer is still in time
            beat = await asyncio.wait_for(
                self.replicas[index].heartbeat.remote(self.timeout_s / 2), self.timeout_s)
        except TimeoutError:
            return f"it did not answer within {self.timeout_s} s"
        except Exception as error:  # its process died, or Ray is restarting it
            return f"it did not answer ({type(error).__name__})"
        self.ledger.record(index, beat)
        return beat.problem

    async def metrics(self) -> list[MetricsSnapshot]:
        """Every replica's figures now, counted across its rebuilds and restarts."""
        alive = await self.check()
        return [totals for totals, replica in zip(self.ledger.totals(alive), self.replicas,
                                                  strict=True) if replica is not None]
