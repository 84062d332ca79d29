"""A replica whose shards find no room fails after the start timeout, with an error that says
so, instead of hanging; its pending placement group goes with it.

The session's Ray has the CPUs, but a placement group of the test holds every free one, so a
replica's group is feasible and pending: what a cluster waiting for a node that never comes
looks like.
"""

import re
import time

import pytest
import ray
from ray.util import placement_group_table
from ray.util.placement_group import placement_group, remove_placement_group

from cluster import EngineConfig
from cluster.ray.replica_start import START_ATTEMPTS, ReplicaStartTimeout
from cluster.ray.serving_policy import ServingPolicy
from cluster.ray.tandem_cluster import TandemCluster
from router.autoscale import AutoscalingPolicy

pytestmark = pytest.mark.ray


def pending_groups() -> int:
    return sum(g["state"] == "PENDING" for g in placement_group_table().values())


def until(condition, seconds=120.0):  # generous: what Ray does, on a busy machine
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def hold_free_cpus():
    """A group of the test holding every CPU nobody uses now (None when none is free)."""
    free = ray.available_resources().get("CPU", 0.0)
    if free <= 0:
        return None
    group = placement_group([{"CPU": free}])
    ray.get(group.ready(), timeout=120)
    return group


def config(tiny_models):
    return EngineConfig(model=str(tiny_models["llama"]), device="cpu", block_size=4,
                        num_kv_blocks=64)


def test_a_replica_without_room_fails_at_start_up_after_the_timeout(ray_session, tiny_models):
    holder = hold_free_cpus()
    try:
        started = time.monotonic()
        with pytest.raises(ReplicaStartTimeout) as error:
            TandemCluster(config(tiny_models), num_replicas=1,
                          policy=ServingPolicy(replica_start_timeout_s=1.5))
        # not before its timeout, and then without hanging (a bound no busy machine reaches)
        assert 1.5 <= time.monotonic() - started < 120
        assert str(error.value) == (
            "replica 0 did not come up within 1.5 s: its shards' placement group found no "
            "node with room, or a shard did not start (a pending group is shown by `ray "
            "status`); raise replica_start_timeout (--replica-start-timeout) if nodes take "
            "longer to arrive")
        # the replica was killed, and its pending group with it
        until(lambda: pending_groups() == 0)
    finally:
        if holder is not None:
            remove_placement_group(holder)


def test_the_autoscaler_removes_a_replica_that_does_not_start_in_time(ray_session, tiny_models):
    scaling = AutoscalingPolicy(min_replicas=2, max_replicas=2, interval_s=3600)
    # the default timeout, 600 s: the autoscaler's clock is the test's
    cluster = TandemCluster(config(tiny_models), num_replicas=1, autoscaling=scaling)
    autoscaler, now = cluster.autoscaler, [0.0]
    assert autoscaler is not None
    autoscaler.clock = lambda: now[0]
    holder = hold_free_cpus()
    try:
        assert autoscaler.tick().reason == "below_min"  # replica 1, whose group waits
        until(lambda: pending_groups() == 1)
        now[0] = 600.0  # not past its time yet
        assert autoscaler.tick().reason == "starting"
        assert autoscaler.starting.keys() == {1}
        now[0] = 600.5
        # removed at this tick; one replica is below the minimum, so another is started
        assert autoscaler.tick().reason == "below_min"
        assert [(a.delta, a.replica) for a in autoscaler.history] == [(1, 1), (1, 2)]
        assert cluster.replica_handles().keys() == {0, 2}
        assert ray.get(cluster.router.stats.remote()).removed == frozenset({1})
        until(lambda: pending_groups() == 1)  # replica 2's; replica 1's went with it
    finally:
        cluster.shutdown()
        if holder is not None:
            remove_placement_group(holder)
    until(lambda: pending_groups() == 0)


def test_a_replica_that_dies_before_it_serves_is_started_again(ray_session, tiny_models,
                                                               monkeypatch, caplog):
    """Its process killed while the cluster waits for it (as a lost node or a worker that
    never started would): the cluster starts it once more and comes up with both."""
    killed = []
    replica_actor = TandemCluster._replica_actor

    def kill_replica_1_first(self, index):
        replica = replica_actor(self, index)
        if index == 1 and not killed:
            killed.append(replica)
            ray.kill(replica, no_restart=True)
        return replica

    monkeypatch.setattr(TandemCluster, "_replica_actor", kill_replica_1_first)
    cluster = TandemCluster(config(tiny_models), num_replicas=2)
    try:
        assert cluster.replicas[1] is not killed[0]  # a new actor in its place
        # with the last line of Ray's word on its death
        assert re.search(r"replica 1 died before it served \(The actor .+\); starting it again",
                         caplog.text)
        for replica in cluster.replicas:
            assert ray.get(replica.info.remote())["max_model_len"] > 0
    finally:
        cluster.shutdown()


def test_a_replica_that_dies_at_every_start_fails_after_the_last_attempt(ray_session,
                                                                       tiny_models,
                                                                       monkeypatch, caplog):
    killed = []
    replica_actor = TandemCluster._replica_actor

    def kill_each_one(self, index):
        replica = replica_actor(self, index)
        killed.append(replica)
        ray.kill(replica, no_restart=True)
        return replica

    monkeypatch.setattr(TandemCluster, "_replica_actor", kill_each_one)
    with pytest.raises(ray.exceptions.ActorDiedError) as error:
        TandemCluster(config(tiny_models), num_replicas=1)
    assert not error.value.actor_init_failed
    assert len(killed) == START_ATTEMPTS == 3 and len(set(map(id, killed))) == 3
    assert caplog.text.count("replica 0 died before it served") == 2


def test_a_replica_whose_engine_fails_to_build_is_not_tried_again(ray_session, tmp_path,
                                                                  caplog):
    """A constructor's own error (a model folder that is no model) would come again: it is
    raised at once, after one attempt."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ray.exceptions.ActorDiedError) as error:
        TandemCluster(EngineConfig(model=str(tmp_path), device="cpu"), num_replicas=1)
    assert error.value.actor_init_failed
    assert "starting it again" not in caplog.text
