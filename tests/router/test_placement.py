"""Placement policies over plain data: exact choices, reasons and pending entries."""

import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.directory import EventBatch, KVDirectory
from kvstore.events import BlockRemoved, BlockStored
from router.placement import (
    LeastLoaded,
    PrefixAffinity,
    ReplicaLoad,
    RoundRobin,
    RoutingRequest,
    make_policy,
)

BLOCK = 16
PREFIX = list(range(1000, 1064))  # four full blocks


def request(question: int, prefix=PREFIX) -> RoutingRequest:
    tokens = prefix + [question] * 8
    return RoutingRequest(hash_full_blocks(tokens, BLOCK), len(tokens), BLOCK)


def holding(replica: int, num_replicas: int = 2, prefix=PREFIX) -> KVDirectory:
    d = KVDirectory(num_replicas)
    events = tuple(BlockStored(h, None) for h in hash_full_blocks(prefix, BLOCK))
    d.apply(EventBatch(replica, "e", 0, events))
    return d


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


IDLE = [ReplicaLoad(), ReplicaLoad()]


def test_a_prefix_goes_to_the_replica_holding_it():
    policy = PrefixAffinity(holding(1))
    decision = policy.choose(IDLE, request(7))
    assert (decision.replica, decision.reason, decision.cached_tokens) == (1, "affinity", 64)


def test_after_its_removal_a_prefix_no_longer_attracts():
    directory = holding(1)
    first = hash_full_blocks(PREFIX, BLOCK)[0]
    directory.apply(EventBatch(1, "e", 1, (BlockRemoved(first),)))
    policy = PrefixAffinity(directory, pending_seconds=0.0)
    decision = policy.choose(IDLE, request(7))
    assert (decision.replica, decision.reason, decision.cached_tokens) == (0, "no_match", 0)


def test_queued_prefill_and_decodes_count_against_a_replica():
    policy = PrefixAffinity(holding(1), decode_weight=10.0, pending_seconds=0.0)
    # replica 1 saves 64 prompt tokens but has 100 prefill tokens queued: 0 is cheaper
    busy = [ReplicaLoad(), ReplicaLoad(num_requests=1, num_prefilling=1, num_prefill_tokens=100)]
    assert policy.choose(busy, request(7)).replica == 0
    # 5 decodes x 10 = 50 < 64 saved: still replica 1; 7 decodes x 10 = 70 > 64: replica 0
    assert policy.choose([ReplicaLoad(), ReplicaLoad(num_requests=5)], request(7)).replica == 1
    assert policy.choose([ReplicaLoad(), ReplicaLoad(num_requests=7)], request(7)).replica == 0


def test_the_load_guard_stops_a_hot_prefix_piling_onto_one_replica():
    policy = PrefixAffinity(holding(1), decode_weight=0.0, max_imbalance=4, pending_seconds=0.0)
    decision = policy.choose([ReplicaLoad(), ReplicaLoad(num_requests=4)], request(7))
    assert (decision.replica, decision.reason) == (1, "affinity")  # 4 more: allowed
    decision = policy.choose([ReplicaLoad(), ReplicaLoad(num_requests=5)], request(7))
    assert (decision.replica, decision.reason, decision.cached_tokens) == (0, "load_guard", 0)


def test_cache_salts_isolate_tenants():
    salted = hash_full_blocks(PREFIX + [7] * 8, BLOCK, extra_keys=("model", "tenant-b"))
    policy = PrefixAffinity(holding(1), pending_seconds=0.0)
    decision = policy.choose(IDLE, RoutingRequest(salted, 72, BLOCK))
    assert (decision.replica, decision.reason) == (0, "no_match")


def test_pending_entries_keep_a_burst_together_and_expire():
    clock = Clock()
    policy = PrefixAffinity(KVDirectory(2), pending_seconds=5.0, clock=clock)
    first = policy.choose(IDLE, request(1))
    assert (first.replica, first.reason) == (0, "no_match")
    # no event has come yet and replica 0 computes the group's prefix for the first request:
    # work the second shares (the engine lets it wait for those blocks), so it goes there too
    queued = ReplicaLoad(num_requests=1, num_prefilling=1, num_prefill_tokens=72)
    second = policy.choose([queued, ReplicaLoad()], request(2))
    assert (second.replica, second.reason, second.cached_tokens) == (0, "affinity", 64)
    clock.now += 5.0
    third = policy.choose([ReplicaLoad(num_requests=2), ReplicaLoad()], request(3))
    assert (third.replica, third.reason) == (1, "no_match")
    assert set(policy.pending) == set(request(3).block_hashes)  # only the new entries remain


def test_a_dead_replica_is_never_chosen():
    loads = [ReplicaLoad(), ReplicaLoad(alive=False)]
    assert PrefixAffinity(holding(1)).choose(loads, request(7)).replica == 0
    assert [RoundRobin().choose(loads, request(7)).replica for _ in range(3)] == [0, 0, 0]
    assert LeastLoaded().choose([ReplicaLoad(num_requests=9),
                                 ReplicaLoad(alive=False)], request(7)).replica == 0
    # when none is alive, requests still get a replica (it waits for the rebuild there)
    assert RoundRobin().choose([ReplicaLoad(alive=False)] * 2, request(7)).replica == 0


def test_same_inputs_give_the_same_decisions():
    def decisions():
        policy, loads = PrefixAffinity(holding(1, 3), clock=Clock()), [ReplicaLoad()] * 3
        return [policy.choose(loads, request(q, prefix)) for q in range(4)
                for prefix in (PREFIX, list(range(64)))]

    assert decisions() == decisions()
    assert [d.replica for d in decisions()] == [1, 0, 1, 0, 1, 0, 1, 0]


def test_round_robin_and_least_loaded():
    robin = RoundRobin()
    assert [robin.choose([ReplicaLoad()] * 3, request(0)).replica for _ in range(4)] == [0, 1, 2, 0]
    least = LeastLoaded()
    loads = [ReplicaLoad(num_requests=2), ReplicaLoad(num_requests=1), ReplicaLoad(num_requests=1)]
    assert [least.choose(loads, request(0)).replica for _ in range(3)] == [1, 2, 1]


def test_unknown_policy_names_are_refused():
    with pytest.raises(ValueError, match="unknown routing policy 'random' \\(choose from "
                                         "prefix-affinity, least-loaded, round-robin\\)"):
        make_policy("random", KVDirectory(1))
    assert isinstance(make_policy("prefix-affinity", KVDirectory(1)), PrefixAffinity)
