"""Bringing replicas up: a readiness timeout, and another try for one whose process died.

A replica is up when its engine is built: its shards' placement group has found a node, the
shards have started and loaded the weights, and the KV cache is allocated. On a cluster
without room its group just stays pending — that is what makes Ray's autoscaler ask for a
node — so waiting is right, but not forever: a node that never comes (a node type the cluster
cannot launch, a quota, a shard stuck at start-up) must end in an error that says so, where
the caller can see it, instead of a hang. Whether a group could be placed at all (more GPUs
than any node has) is another check's question: this one only bounds the wait.

A replica whose process died before it served (a node lost as it started, a worker that
never started, an actor Ray cancelled before it ran) would come up on another try: Ray does
not restart an actor that never ran, so ``start_replicas`` does. A constructor's own error (a
folder that is no model) is raised at once: it would come again.

The timeout is ``ServingPolicy.replica_start_timeout_s`` (``--replica-start-timeout``).
Killing a late replica also removes its placement group (Ray removes a group with the actor
that made it), so a pending group does not keep asking for a node nobody waits for.
"""

import logging
from collections.abc import Callable, Mapping

import ray

log = logging.getLogger(__name__)

START_ATTEMPTS = 3  # a replica that died before it served is started twice more


class ReplicaStartTimeout(RuntimeError):
    """A replica's engine was not built within the start timeout."""


def late_message(indices: list[int], timeout_s: float) -> str:
    which = ", ".join(map(str, indices))
    return (f"replica {which} did not come up within {timeout_s:g} s: its shards' placement "
            "group found no node with room, or a shard did not start (a pending group is "
            "shown by `ray status`); raise replica_start_timeout (--replica-start-timeout) if "
            "nodes take longer to arrive")


class ReplicasDied(RuntimeError):
    """Replicas whose process died before their engine was built, not of an error their own
    constructor raised (that one would come again): a lost node, a worker that never started,
    an actor Ray cancelled before it ran. ``error``: the first one's, raised once the cluster
    gives up on starting them."""

    def __init__(self, died: Mapping[int, ray.exceptions.ActorDiedError]) -> None:
        super().__init__(f"replica {', '.join(map(str, died))} died before it served")
        self.indices = list(died)
        self.error = next(iter(died.values()))


def wait_for_replicas(ready: Mapping[int, ray.ObjectRef], timeout_s: float) -> list:
    """Each replica's ``info()`` once its engine is built, in ``ready``'s order; raises
    ``ReplicaStartTimeout`` naming every replica not up after ``timeout_s``, the error a
    replica's constructor raised if one failed, else ``ReplicasDied`` naming those whose
    process died (each answers at once, so all are known)."""
    refs = list(ready.values())
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    finished = set(done)
    late = [index for index, ref in ready.items() if ref not in finished]
    if late:
        raise ReplicaStartTimeout(late_message(late, timeout_s))
    infos, died = [], {}
    for index, ref in ready.items():
        try:
            infos.append(ray.get(ref))
        except ray.exceptions.ActorDiedError as error:
            if error.actor_init_failed:
                raise
            died[index] = error
    if died:
        raise ReplicasDied(died)
    return infos


def overdue(started_at: float, now: float, timeout_s: float) -> bool:
    """For a replica polled while it starts (the autoscaler's): is it past its time?"""
    return now - started_at > timeout_s


def start_replicas(replicas: list, start_again: Callable[[int], object],
                   timeout_s: float) -> list:
    """Every replica's info once it is up. A replica whose process died before its engine
    was built (its node lost, its worker never started: Ray does not restart an actor that
    never ran) is started again with ``start_again(index)``, which replaces it in
    ``replicas``; ``START_ATTEMPTS`` in all, then its death is raised. The caller stops the
    actors on any error (their pending placement groups go with them)."""
    attempt = 1
    while True:
        try:
            return wait_for_replicas({index: replica.info.remote()
                                      for index, replica in enumerate(replicas)}, timeout_s)
        except ReplicasDied as died:
            if attempt == START_ATTEMPTS:
                raise died.error from None
            log.warning("%s (%s); starting it again", died,
                        str(died.error).strip().splitlines()[-1])
            for index in died.indices:
                replicas[index] = start_again(index)
        attempt += 1
