"""A load that stays put while a test looks at it: replicas whose engines can be held.

A load step of long requests on a tiny model is over in a second or two, and on a busy machine
the last request may arrive after the first has finished, so "12 sequences running" might never
be seen at once. A held replica steps only once ``num_seqs`` sequences are in its engine, and
stops stepping once they all run with a token each, until ``release``: the load the autoscaler
samples is real (the engine's own scheduler ran it) and stays until the test lets it go.
"""

import time

import ray

from cluster.engine.llm_engine import LLMEngine
from cluster.ray.replica import REPLICA_ACTOR_OPTIONS, ReplicaActor
from cluster.ray.tandem_cluster import TandemCluster

POLL_S = 0.01  # a held engine's loop looks again this often (it is only a test's)


class HeldReplica(ReplicaActor):
    hold_at: int | None = None

    async def hold(self, num_seqs: int) -> None:
        self.hold_at = num_seqs

    async def release(self) -> None:
        self.hold_at = None

    def _new_engine(self) -> LLMEngine:
        engine = super()._new_engine()
        step = engine.step_deltas

        def held_step():  # type: ignore[no-untyped-def]
            if self.hold_at is not None and not self._steps(engine, self.hold_at):
                time.sleep(POLL_S)
                return []
            return step()

        engine.step_deltas = held_step  # type: ignore[method-assign]
        return engine

    @staticmethod
    def _steps(engine: LLMEngine, num_seqs: int) -> bool:
        scheduler = engine.scheduler
        arrived = len(scheduler.waiting) + len(scheduler.running) >= num_seqs
        loaded = len(scheduler.running) >= num_seqs and all(
            seq.num_output_tokens >= 1 for seq in scheduler.running)
        return arrived and not loaded


class HeldCluster(TandemCluster):
    """A TandemCluster of HeldReplicas (those the autoscaler adds too)."""

    def _replica_actor(self, index: int):  # type: ignore[no-untyped-def]
        return ray.remote(HeldReplica).options(**REPLICA_ACTOR_OPTIONS).remote(
            self.config, index, self.router_address)

    def hold(self, num_seqs: int) -> None:
        ray.get([replica.hold.remote(num_seqs) for replica in self.replicas])

    def release(self) -> None:
        ray.get([replica.release.remote() for replica in self.replicas])
