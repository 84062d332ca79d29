"""How long a replica may take to come up: a readiness timeout, nothing more.

A replica is up when its engine is built: its shards' placement group has found a node, the
shards have started and loaded the weights, and the KV cache is allocated. On a cluster
without room its group just stays pending — that is what makes Ray's autoscaler ask for a
node — so waiting is right, but not forever: a node that never comes (a node type the cluster
cannot launch, a quota, a shard stuck at start-up) must end in an error that says so, where
the caller can see it, instead of a hang. Whether a group could be placed at all (more GPUs
than any node has) is another check's question: this one only bounds the wait.

The timeout is ``ServingPolicy.replica_start_timeout_s`` (``--replica-start-timeout``).
Killing a late replica also removes its placement group (Ray removes a group with the actor
that made it), so a pending group does not keep asking for a node nobody waits for.
"""

from collections.abc import Mapping

import ray

START_ATTEMPTS = 2  # a replica that died before it served is started once more
DEAD_PROBE_S = 1.0  # a dead actor answers a call with its death at once


class ReplicaStartTimeout(RuntimeError):
    """A replica's engine was not built within the start timeout."""


def late_message(indices: list[int], timeout_s: float) -> str:
    which = ", ".join(map(str, indices))
    return (f"replica {which} did not come up within {timeout_s:g} s: its shards' placement "
            "group found no node with room, or a shard did not start (a pending group is "
            "shown by `ray status`); raise replica_start_timeout (--replica-start-timeout) if "
            "nodes take longer to arrive")


def wait_for_replicas(ready: Mapping[int, ray.ObjectRef], timeout_s: float) -> list:
    """Each replica's ``info()`` once its engine is built, in ``ready``'s order; raises
    ``ReplicaStartTimeout`` naming every replica not up after ``timeout_s``, and the error
    one of them raised while starting if one failed."""
    refs = list(ready.values())
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    finished = set(done)
    late = [index for index, ref in ready.items() if ref not in finished]
    if late:
        raise ReplicaStartTimeout(late_message(late, timeout_s))
    return ray.get(refs)


def overdue(started_at: float, now: float, timeout_s: float) -> bool:
    """For a replica polled while it starts (the autoscaler's): is it past its time?"""
    return now - started_at > timeout_s


def died_before_serving(replicas: Mapping[int, object]) -> list[int]:
    """The replicas (index -> actor handle) whose process died (not of an error their own
    constructor raised): each is asked for its info, and a dead one answers with
    ActorDiedError at once; one still building its engine (or up) is not."""
    refs = {index: replica.info.remote() for index, replica in replicas.items()}  # type: ignore[attr-defined]
    done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=DEAD_PROBE_S)
    dead = []
    for index, ref in refs.items():
        if ref not in done:
            continue
        try:
            ray.get(ref)
        except ray.exceptions.ActorDiedError as error:
            if not error.actor_init_failed:  # its constructor's error would come again
                dead.append(index)
        except ray.exceptions.RayError:
            pass
    return dead
