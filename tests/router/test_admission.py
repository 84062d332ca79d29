"""Overload control, draining, failover bookkeeping and health in the router's plain state."""

import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.directory import EventBatch
from kvstore.events import BlockStored
from router.admission import AdmissionLimits, Refusal
from router.replica_router import ClusterHealth, ReplicaRouter

BLOCK = 4


def place(router: ReplicaRouter, request_id: str, num_tokens: int = 8, **options):
    tokens = list(range(num_tokens))
    decision = router.assign(request_id, hash_full_blocks(tokens, BLOCK), num_tokens, BLOCK,
                             **options)
    return decision if isinstance(decision, Refusal) else decision.replica


def test_past_the_waiting_requests_limit_a_new_request_is_refused():
    router = ReplicaRouter(2, "least-loaded", limits=AdmissionLimits(max_waiting_requests=2))
    assert [place(router, f"r{i}") for i in range(4)] == [0, 1, 0, 1]
    assert place(router, "r4") == Refusal("overloaded")
    router.first_token("r1")  # replica 1 has room again: only it may take the next one
    assert [place(router, "r5"), place(router, "r6")] == [1, Refusal("overloaded")]
    assert router.stats().rejected == {"overloaded": 2}
    assert "r4" not in router.placed and router.num_in_flight == 5


def test_the_waiting_tokens_limit_counts_prompt_tokens_and_lets_a_long_one_in_alone():
    router = ReplicaRouter(1, "least-loaded", limits=AdmissionLimits(max_waiting_tokens=100))
    assert place(router, "long", num_tokens=150) == 0  # alone: it could never fit otherwise
    assert place(router, "next", num_tokens=8) == Refusal("overloaded")
    router.first_token("long")
    assert [place(router, "a", num_tokens=60), place(router, "b", num_tokens=40)] == [0, 0]
    assert place(router, "c", num_tokens=1) == Refusal("overloaded")


def test_a_continued_request_is_never_refused_and_avoids_the_replica_it_lost():
    router = ReplicaRouter(2, "least-loaded", limits=AdmissionLimits(max_waiting_requests=1))
    assert [place(router, "a"), place(router, "b")] == [0, 1]
    router.lost("a", 0, process_died=False)
    assert router.failovers == 1 and "a" not in router.placed
    # full everywhere, and replica 1 is busier, but replica 0 just lost it
    assert place(router, "a", exclude=[0], resumed=True) == 1
    # every replica lost under it: it waits for one of them rather than failing
    assert place(router, "c", exclude=[0, 1], resumed=True) in (0, 1)


def test_a_replica_whose_process_died_is_down_until_it_is_seen_again():
    router = ReplicaRouter(2, "least-loaded")
    router.directory.apply(EventBatch(0, "e", 0, (BlockStored(hash_full_blocks(
        list(range(8)), BLOCK)[0], None),)))
    assert place(router, "a") == 0
    router.lost("a", 0, process_died=True)
    assert router.alive == [False, True] and router.directory.num_blocks == 0
    assert router.health() == ClusterHealth([False, True])
    assert router.health().status == "degraded"
    assert [place(router, f"n{i}") for i in range(3)] == [1, 1, 1]
    router.set_health([True, True])
    assert router.health().status == "ok" and place(router, "n3") == 0


def test_draining_refuses_new_requests_but_continues_placed_ones():
    router = ReplicaRouter(1, "round-robin")
    assert place(router, "a") == 0
    assert router.drain_all() == 1 and router.health().status == "draining"
    assert place(router, "b") == Refusal("draining")
    router.lost("a", 0, process_died=False)
    assert place(router, "a", exclude=[0], resumed=True) == 0
    router.release("a")
    assert router.num_in_flight == 0
    assert router.stats().rejected == {"draining": 1}


@pytest.mark.parametrize(("alive", "status"), [([True, True], "ok"), ([True, False], "degraded"),
                                               ([False, False], "unavailable")])
def test_health_status(alive, status):
    assert ClusterHealth(alive).status == status


def test_negative_limits_are_refused():
    with pytest.raises(ValueError, match="admission limits must be >= 0"):
        AdmissionLimits(max_waiting_requests=-1)
