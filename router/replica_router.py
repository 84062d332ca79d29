"""The cluster's routing state, as plain data: the KV directory, every replica's load, the policy.

The router actor (cluster/ray/router_actor.py) wraps one ``ReplicaRouter`` and carries out what
it asks for (a replica's cache dump after a gap in its events); everything decided is here.
"""

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvstore.block_hash import BlockHash
from kvstore.directory import CacheDump, EventBatch, KVDirectory
from router.admission import AdmissionLimits, Refusal, admissible
from router.kv_pricing import TransferRates
from router.placement import Decision, PrefixAffinity, ReplicaLoad, RoutingRequest, make_policy


@dataclass
class Placed:
    replica: int
    prefill_tokens: int  # prompt tokens not expected cached there
    prefilling: bool = True  # no first token yet


@dataclass(frozen=True)
class RouterStats:
    decisions: dict[str, int]  # by reason
    directory_blocks: int
    event_lag_s: float | None  # the last batch: its step's end to its arrival here
    loads: list[ReplicaLoad]
    resyncs: int
    blocks_held: list[int] = field(default_factory=list)  # per replica, in its device cache
    removed: frozenset[int] = frozenset()  # replicas the autoscaler took away (indices stay)
    failovers: int = 0  # requests moved to another replica after theirs was lost
    rejected: dict[str, int] = field(default_factory=dict)  # refused, by Refusal reason
    host_blocks_held: list[int] = field(default_factory=list)  # per replica, in its host tier


@dataclass(frozen=True)
class ClusterHealth:
    alive: list[bool]  # per replica: its engine and every shard answer
    draining: bool = False  # shutting down: new requests are refused

    @property
    def status(self) -> str:
        """ok | degraded (some replica is down or rebuilding; the others serve) |
        unavailable (none serves) | draining."""
        if self.draining:
            return "draining"
        if all(self.alive):
            return "ok"
        return "degraded" if any(self.alive) else "unavailable"


class ReplicaRouter:
    def __init__(self, num_replicas: int, policy: str = "prefix-affinity",
                 clock: Callable[[], float] = time.time,
                 limits: AdmissionLimits | None = None) -> None:
        self.directory = KVDirectory(num_replicas)
        self.limits = limits or AdmissionLimits()
        self.draining = False
        self.failovers = 0
        self.rejected: Counter[str] = Counter()
        self.policy = make_policy(policy, self.directory)
        self.alive = [True] * num_replicas
        # the autoscaler's: a draining replica gets no new requests; a removed one is gone
        # for good (indices are never reused, so a late event or stream can't be mistaken)
        self.accepting = [True] * num_replicas
        self.removed: set[int] = set()
        self.placed: dict[str, Placed] = {}
        # per replica, kept as requests come and go (a decision must not walk every request)
        self.num_requests = [0] * num_replicas
        self.num_prefilling = [0] * num_replicas
        self.num_prefill_tokens = [0] * num_replicas
        self.decisions: Counter[str] = Counter()
        self.event_lag_s: float | None = None
        self.resyncs = 0
        self.clock = clock

    @property
    def num_replicas(self) -> int:
        return len(self.alive)

    def set_rates(self, rates: TransferRates | None) -> None:
        """The rates measured at start-up, which price pulls between replicas' host tiers
        (prefix-affinity routing only; None: no pulls)."""
        if isinstance(self.policy, PrefixAffinity):
            self.policy.set_rates(rates)

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(*load) for load in zip(
            self.alive, self.num_requests, self.num_prefilling, self.num_prefill_tokens,
            self.accepting, strict=True)]

    def assign(self, request_id: str, block_hashes: Sequence[BlockHash],
               num_prompt_tokens: int, block_size: int, exclude: Sequence[int] = (),
               resumed: bool = False) -> Decision | Refusal:
        """``exclude``: replicas lost under this request already (tried again only when no
        other is alive); ``resumed``: it continues after a loss, so it was admitted before
        and is not refused now."""
        if request_id in self.placed:
            raise ValueError(f"request id '{request_id}' is already placed")
        loads = [replace(load, alive=load.alive and index not in exclude)
                 for index, load in enumerate(self.loads())]
        if not resumed:
            admitted = self._admit(loads, num_prompt_tokens)
            if isinstance(admitted, Refusal):
                self.rejected[admitted.reason] += 1
                return admitted
            loads = admitted
        request = RoutingRequest(block_hashes, num_prompt_tokens, block_size)
        decision = self.policy.choose(loads, request)
        placed = Placed(decision.replica, num_prompt_tokens - decision.cached_tokens)
        self.placed[request_id] = placed
        self.num_requests[placed.replica] += 1
        self.num_prefilling[placed.replica] += 1
        self.num_prefill_tokens[placed.replica] += placed.prefill_tokens
        self.decisions[decision.reason] += 1
        return decision

    def _admit(self, loads: list[ReplicaLoad],
               num_prompt_tokens: int) -> list[ReplicaLoad] | Refusal:
        if self.draining:
            return Refusal("draining")
        admitted = admissible(loads, self.limits, num_prompt_tokens)
        return Refusal("overloaded") if admitted is None else admitted

    def first_token(self, request_id: str) -> None:
        placed = self.placed.get(request_id)
        if placed is not None and placed.prefilling:
            self._prefilled(placed)

    def release(self, request_id: str) -> None:
        placed = self.placed.pop(request_id, None)
        if placed is not None:
            if placed.prefilling:
                self._prefilled(placed)
            self.num_requests[placed.replica] -= 1

    def _prefilled(self, placed: Placed) -> None:
        placed.prefilling = False
        self.num_prefilling[placed.replica] -= 1
        self.num_prefill_tokens[placed.replica] -= placed.prefill_tokens

    def report(self, batch: EventBatch) -> bool:
        """Applies a replica's batch; True when its dump is needed (pass it to ``resync``)."""
        if batch.replica in self.removed:
            return False  # sent before it was removed: its blocks went with it
        self.event_lag_s = max(0.0, self.clock() - batch.created_at)
        needs_dump = self.directory.apply(batch)
        self.resyncs += needs_dump
        return needs_dump

    def resync(self, dump: CacheDump) -> bool:
        if dump.replica in self.removed:
            return False
        return self.directory.resync(dump)

    def replica_down(self, replica: int) -> None:
        """The replica lost its engine: nothing is routed there, and it holds nothing."""
        self.alive[replica] = False
        self.directory.remove_replica(replica)

    def replica_up(self, replica: int) -> None:
        if replica not in self.removed:
            self.alive[replica] = True

    def add_replica(self) -> int:
        """A slot for a new replica, not alive until it reports up; its index."""
        index = self.directory.add_replica()
        self.alive.append(False)
        self.accepting.append(True)
        for count in (self.num_requests, self.num_prefilling, self.num_prefill_tokens):
            count.append(0)
        return index

    def drain(self, replica: int) -> None:
        """No new request goes to the replica; those in flight there go on."""
        self._check_present(replica)
        if sum(self.accepting) == 1 and self.accepting[replica]:
            raise ValueError(f"replica {replica} is the last one accepting requests")
        self.accepting[replica] = False

    def remove(self, replica: int) -> None:
        """The replica is gone (drained, then stopped): it never comes back."""
        self._check_present(replica)
        self.accepting[replica] = self.alive[replica] = False
        self.removed.add(replica)
        self.directory.remove_replica(replica)

    def restore(self, present: Sequence[int]) -> None:
        """Makes the replicas the cluster has, and only those, present: after this router was
        restarted (built again with the cluster's first count), the autoscaler may have added
        some, taken as alive, and removed others."""
        for index in range(self.num_replicas, max(present, default=-1) + 1):
            self.add_replica()
            if index in present:
                self.replica_up(index)
        for index in self.present():
            if index not in present:
                self.remove(index)

    def _check_present(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas or replica in self.removed:
            raise ValueError(f"no replica {replica} (present: {self.present()})")

    def present(self) -> list[int]:
        """The replicas not removed, draining ones included."""
        return [index for index in range(self.num_replicas) if index not in self.removed]

    def lost(self, request_id: str, replica: int, process_died: bool) -> None:
        """The request's replica was lost under it: it is placed again (a failover); a replica
        whose process died is down until its restart or the health check says otherwise."""
        self.release(request_id)
        self.failovers += 1
        if process_died and self.alive[replica]:
            self.replica_down(replica)

    def set_health(self, alive: Sequence[bool]) -> None:
        """The health check's view of every replica; a replica found down drops out of the
        directory (its cache went with its engine)."""
        for replica, up in enumerate(alive):
            if up and not self.alive[replica]:
                self.replica_up(replica)
            elif not up and self.alive[replica]:
                self.replica_down(replica)

    def health(self) -> ClusterHealth:
        return ClusterHealth(list(self.alive), self.draining)

    def drain_all(self) -> int:
        """Refuses new requests from now on (continuations of placed ones still go through);
        returns how many are in flight."""
        self.draining = True
        return len(self.placed)

    @property
    def num_in_flight(self) -> int:
        return len(self.placed)

    def stats(self) -> RouterStats:
        return RouterStats(dict(self.decisions), self.directory.num_blocks, self.event_lag_s,
                           self.loads(), self.resyncs,
                           [len(view.hashes) for view in self.directory.replicas],
                           frozenset(self.removed), self.failovers, dict(self.rejected),
                           [len(view.host_hashes) for view in self.directory.replicas])
