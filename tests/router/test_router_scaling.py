"""The router's side of autoscaling: a replica added later, drained (no new requests, those in
flight go on), then removed for good; late events from it change nothing."""

import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.directory import CacheDump, EventBatch
from kvstore.events import BlockStored
from router.replica_router import ReplicaRouter

BLOCK = 4
PROMPT = list(range(16))
HASHES = hash_full_blocks(PROMPT, BLOCK)


def assign(router, request_id):
    return router.assign(request_id, HASHES, len(PROMPT), BLOCK).replica


def test_an_added_replica_takes_requests_once_it_reports_up():
    router = ReplicaRouter(1, "least-loaded")
    assign(router, "a")
    assert router.add_replica() == 1
    assert assign(router, "b") == 0  # not up yet: its engine is still loading
    router.replica_up(1)
    assert assign(router, "c") == 1
    assert [load.num_requests for load in router.loads()] == [2, 1]
    router.directory.check_integrity()


def test_a_draining_replica_gets_nothing_new_and_keeps_what_it_has():
    router = ReplicaRouter(2, "least-loaded")
    assert [assign(router, r) for r in ("a", "b")] == [0, 1]
    router.drain(1)
    assert [assign(router, r) for r in ("c", "d")] == [0, 0]
    assert router.num_requests == [3, 1]  # "b" still counts there until it finishes
    router.first_token("b")
    router.release("b")
    assert router.num_requests == [3, 0]
    # a restart of the draining replica's engine does not let it take requests again
    router.replica_down(1)
    router.replica_up(1)
    assert assign(router, "e") == 0


def test_a_removed_replica_is_gone_for_good_and_its_late_events_are_dropped():
    router = ReplicaRouter(2, "prefix-affinity")
    events = tuple(BlockStored(h, None) for h in HASHES)
    router.report(EventBatch(1, "e", 0, events))
    assert router.directory.num_blocks == 4
    router.drain(1)
    router.remove(1)
    assert router.directory.num_blocks == 0 and router.present() == [0]
    assert router.report(EventBatch(1, "e", 1, events)) is False  # sent before it stopped
    assert router.resync(CacheDump(1, "e", 1, HASHES)) is False
    router.replica_up(1)
    assert router.directory.num_blocks == 0 and assign(router, "a") == 0
    assert router.stats().removed == frozenset({1})
    router.directory.check_integrity()


def test_the_last_accepting_replica_cannot_drain_and_unknown_ones_are_named():
    router = ReplicaRouter(2)
    router.drain(0)
    with pytest.raises(ValueError, match="replica 1 is the last one accepting requests"):
        router.drain(1)
    router.remove(0)
    with pytest.raises(ValueError, match=r"no replica 0 \(present: \[1\]\)"):
        router.drain(0)
    with pytest.raises(ValueError, match=r"no replica 5 \(present: \[1\]\)"):
        router.remove(5)


def test_a_restarted_router_is_restored_to_the_replicas_the_cluster_has():
    router = ReplicaRouter(2, "least-loaded")  # as built again: the first count
    router.restore([0, 3])  # 1 and 2 were removed; 3 was added (and is running)
    assert router.present() == [0, 3] and router.num_replicas == 4
    assert [assign(router, r) for r in ("a", "b", "c")] == [0, 3, 0]
    router.restore([0, 3])  # again: nothing changes
    assert router.present() == [0, 3] and router.num_replicas == 4
    router.directory.check_integrity()
