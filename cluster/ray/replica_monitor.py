"""The cluster's active health check: every period, each replica and its shards are pinged.

A replica whose process died, or whose engine is rebuilding, or one of whose shards no longer
answers, is reported down to the router (which then places nothing there and says so on
/health); it is reported up again once it answers whole. A dead shard found this way makes its
replica rebuild at once, so a fault on an idle replica is found within a period, not by the
next request that fails. Which replica and why goes to this actor's log, when it changes.

Each ping also brings the replica's metrics, which the ledger keeps across the replica's
processes (metrics_ledger.py); /metrics reads them here.

Ray restarts this actor if it dies: it finds the router again by name, and the replicas in the
router's list (the owner keeps it current), then goes on checking; its ledger starts again
from the replicas' own counts.
"""

import asyncio
import logging

from cluster.engine.metrics import MetricsSnapshot
from cluster.ray.metrics_ledger import MetricsLedger
from cluster.ray.router_actor import RouterAddress

log = logging.getLogger(__name__)

MONITOR_ACTOR_OPTIONS = {"max_restarts": -1, "num_cpus": 0}


class ReplicaMonitor:
    def __init__(self, router: RouterAddress, period_s: float, timeout_s: float) -> None:
        self.router = router.lookup()
        self.replicas: list | None = None  # by index, None where removed; from the router
        self.period_s, self.timeout_s = period_s, timeout_s
        self.ledger = MetricsLedger(0)
        self.problems: list[str | None] = []
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
        if self.replicas is None:  # the first round in this process: the router's list
            handles = await self.router.replica_handles.remote()  # type: ignore[attr-defined]
            if self.replicas is None:  # the owner's, if it came meanwhile, is as new
                await self.set_replicas([handles.get(i)
                                         for i in range(max(handles, default=-1) + 1)])
        problems = await asyncio.gather(*[self._ping(index) for index in range(len(
            self.problems))])
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
        replica = self.replicas[index] if self.replicas is not None else None
        if replica is None:  # removed by the autoscaler: nothing to watch
            return None
        try:
            # half the time for its shards' answers, so its own answer is still in time
            beat = await asyncio.wait_for(
                replica.heartbeat.remote(self.timeout_s / 2), self.timeout_s)
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
