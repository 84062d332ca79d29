"""Carries out router/autoscale.py's decisions on the engine replicas of a ``TandemCluster``.

Each interval it samples every serving replica (``ReplicaActor.load_sample``), asks ``decide``,
and acts:

- up: a new ``ReplicaActor``, whose shards ask for a placement group of their own. On a cluster
  without room that group stays pending, and a pending group is what makes Ray's autoscaler
  ask KubeRay (or the cloud provider of ``ray up``) for a GPU node; tandem schedules nothing
  itself. The replica takes requests once its engine is built and it reports up.
- down: the replica with the fewest requests in flight is drained (the router sends it nothing
  new; its requests go on to the end), then stopped; its placement group goes with its
  shards, and Ray's autoscaler returns the idle node after its own idle timeout.

It runs in a thread of the process that owns the cluster (``EngineHost`` under Serve), so it
works whatever event loop the owner runs. A start or a drain is polled at each tick, never
waited for: sampling goes on while a replica waits minutes for a node.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import ray

from cluster.engine.metrics import TTFT_BUCKETS
from cluster.ray.replica_start import late_message, overdue
from router.autoscale import (
    AutoscalingPolicy,
    ReplicaSignals,
    ScalingClock,
    ScalingDecision,
    decide,
    replica_to_drain,
)
from router.histogram_window import HistogramWindow


class ScalableCluster(Protocol):
    """What the autoscaler asks of the cluster it scales (``TandemCluster`` is one): written
    here so that this module needs nothing of the cluster's own."""

    router: Any  # the router actor's handle
    policy: Any  # ServingPolicy: replica_start_timeout_s

    def start_replica(self) -> tuple[int, ray.ObjectRef]: ...
    def replica_serving(self, index: int, info: dict) -> None: ...
    def replica_handles(self) -> dict[int, object]: ...
    def remove_replica(self, index: int, timeout_s: float = 60.0,
                       started: bool = True) -> None: ...


log = logging.getLogger(__name__)

SAMPLE_TIMEOUT_S = 10.0  # a replica slower than this to answer skips the tick


@dataclass(frozen=True)
class Action:
    """A replica started (+1) or drained (-1), as the log says it."""

    delta: int
    reason: str
    replica: int
    num_serving: int  # when it was decided
    in_flight: int  # requests on the replica as its drain began (0 for a start)


class ReplicaAutoscaler:
    def __init__(self, cluster: ScalableCluster, policy: AutoscalingPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster, self.policy, self.clock = cluster, policy, clock
        self.scaling_clock = ScalingClock()
        self.windows: dict[int, HistogramWindow] = {}  # TTFT counts per replica
        self.starting: dict[int, ray.ObjectRef] = {}  # index -> its info(), ready when built
        self.started_at: dict[int, float] = {}  # index -> when it was started
        self.draining: dict[int, float] = {}  # index -> when its drain began
        self.last: ScalingDecision | None = None
        self.history: list[Action] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandem-autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=SAMPLE_TIMEOUT_S + self.policy.interval_s)

    def _run(self) -> None:
        while not self._stop.wait(self.policy.interval_s):
            try:
                self.tick()
            except Exception:  # a replica or the router restarting: the next tick tries again
                log.exception("autoscaler tick failed")

    def serving(self) -> list[int]:
        """Replicas that take requests: started, not draining."""
        return [index for index in self.cluster.replica_handles()
                if index not in self.starting and index not in self.draining]

    def tick(self) -> ScalingDecision | None:
        """One sample and decision; None when a replica did not answer (nothing decided)."""
        now = self.clock()
        self._poll_starting(now)
        self._poll_draining(now)
        # the owner's list is the truth; a router restarted since gets its slots back
        ray.get(self.cluster.router.sync_replicas.remote(self.cluster.replica_handles()))
        serving = self.serving()
        signals = self._sample(serving, now)
        if signals is None:
            return None
        decision = decide(self.policy, signals, self.scaling_clock, now,
                          num_starting=len(self.starting), num_draining=len(self.draining))
        self.scaling_clock, self.last = decision.clock, decision
        if decision.delta > 0:
            index, ready = self.cluster.start_replica()
            self.starting[index], self.started_at[index] = ready, now
            self._record(decision, index, len(serving), 0)
        elif decision.delta < 0:
            loads = ray.get(self.cluster.router.get_loads.remote())
            index = replica_to_drain({replica: loads[replica] for replica in serving})
            ray.get(self.cluster.router.drain.remote(index))
            self.draining[index] = now
            self._record(decision, index, len(serving), loads[index])
        return decision

    def _record(self, decision: ScalingDecision, replica: int, num_serving: int,
                in_flight: int) -> None:
        log.info("autoscaler: %s replica %d (%s: %s at %.2f of target; %d serving, %d "
                 "requests in flight there)", "starting" if decision.delta > 0 else "draining",
                 replica, decision.reason, decision.signal, decision.load_ratio, num_serving,
                 in_flight)
        self.history.append(Action(decision.delta, decision.reason, replica, num_serving,
                                   in_flight))

    def _sample(self, serving: list[int], now: float) -> list[ReplicaSignals] | None:
        handles = self.cluster.replica_handles()
        refs = [handles[index].load_sample.remote() for index in serving]  # type: ignore[attr-defined]
        try:
            samples = ray.get(refs, timeout=SAMPLE_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as error:
            log.warning("autoscaler: a replica did not answer (%r); deciding next time", error)
            return None
        signals = []
        for index, sample in zip(serving, samples, strict=True):
            window = self.windows.setdefault(
                index, HistogramWindow(TTFT_BUCKETS, self.policy.ttft_window_s))
            window.add(now, sample.ttft_counts)
            signals.append(ReplicaSignals(sample.waiting_prompt_tokens, sample.running_seqs,
                                          sample.kv_usage, window.quantile(0.9)))
        return signals

    def _poll_starting(self, now: float) -> None:
        timeout_s = self.cluster.policy.replica_start_timeout_s
        for index, ready in list(self.starting.items()):
            done, _ = ray.wait([ready], timeout=0)
            if not done and not overdue(self.started_at[index], now, timeout_s):
                continue  # its placement group may be waiting for a node
            del self.starting[index], self.started_at[index]
            if not done:  # killing it takes its pending placement group away too
                log.error("autoscaler: %s; removing it", late_message([index], timeout_s))
                self.cluster.remove_replica(index, started=False)
                continue
            try:
                self.cluster.replica_serving(index, ray.get(ready))
                log.info("autoscaler: replica %d is serving", index)
            except ray.exceptions.RayError as error:
                log.error("autoscaler: replica %d failed to start, removing it: %r", index, error)
                self.cluster.remove_replica(index)

    def _poll_draining(self, now: float) -> None:
        if not self.draining:
            return
        loads = ray.get(self.cluster.router.get_loads.remote())
        for index, since in list(self.draining.items()):
            if loads[index] and now - since < self.policy.drain_timeout_s:
                continue
            if loads[index]:
                log.warning("autoscaler: replica %d still had %d requests after %.0f s of "
                            "draining; they fail now", index, loads[index], now - since)
            del self.draining[index]
            self.windows.pop(index, None)
            self.cluster.remove_replica(index)
            log.info("autoscaler: replica %d drained and removed", index)
