"""Engine replicas follow the load, on the CPU: a load step grows the cluster from 1 to 2
replicas (a new placement group: what makes Ray's autoscaler ask for a node), the new one
serves; a lighter load shrinks it back, the replica leaving drains first, and every request
finishes with its whole output.

The autoscaler's own thread is left asleep (an interval of an hour) and the test calls its
``tick`` with a fake clock: the delays pass at once, and each decision is taken exactly where
the test has set the load up for it.
"""

import asyncio
import time

import pytest
import ray
from ray.util import placement_group_table

from cluster import EngineConfig, SamplingParams
from cluster.ray.tandem_cluster import TandemCluster
from router.autoscale import AutoscalingPolicy
from tests.cluster.ray.held_replicas import HeldCluster

pytestmark = pytest.mark.ray

WAIT_S = 120  # for what Ray's processes do in their own time: generous on a busy machine

# 12 sequences running are 3x a target of 4; one on each of 2 replicas is 0.25, which one
# replica would carry at 0.5: under the band, so the cluster shrinks while both still serve
POLICY = AutoscalingPolicy(min_replicas=1, max_replicas=2, target_running_seqs=4,
                           target_waiting_prompt_tokens=10**6, target_kv_usage=1.0,
                           upscale_delay_s=1, downscale_delay_s=5, interval_s=3600)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def created_groups() -> int:
    return sum(g["state"] == "CREATED" for g in placement_group_table().values())


async def complete(cluster, request_id, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async for output in cluster.generate([5, 6, 7, 8], params, request_id):
        last = output
    return last.outputs[0].token_ids, last.outputs[0].finish_reason


def test_load_adds_a_replica_and_a_lighter_load_drains_it_away(ray_session, tiny_models):
    groups_before = created_groups()
    # host tiers: each replica measures its copy and prefill rates, which price pulls
    cluster = HeldCluster(EngineConfig(model=str(tiny_models["llama"]), device="cpu",
                                         block_size=4, num_kv_blocks=1024,
                                         host_kv_cache_gb=0.001),
                            num_replicas=1, routing="least-loaded", autoscaling=POLICY)
    assert list(cluster.measured_rates) == [0]
    # an HTTP ingress replica's view, attached before the cluster grew: it finds the new
    # replica through the router
    view = TandemCluster.attach(cluster.handles())
    autoscaler, clock = cluster.autoscaler, FakeClock()
    assert autoscaler is not None
    autoscaler.clock = clock

    def loads():
        return [load.num_requests for load in ray.get(cluster.router.stats.remote()).loads]

    def running():
        handles = cluster.replica_handles()
        return [ray.get(handles[i].load_sample.remote()).running_seqs
                for i in autoscaler.serving()]

    async def tick(seconds=0.0):
        clock.now += seconds
        return await asyncio.to_thread(autoscaler.tick)

    async def until(condition, seconds=WAIT_S):
        deadline = time.monotonic() + seconds
        while not await asyncio.to_thread(condition):
            assert time.monotonic() < deadline, autoscaler.history
            await asyncio.sleep(0.05)

    async def scenario():
        # a load step: 12 long requests on the one replica
        # held until the ticks have seen it (held_replicas.py)
        await asyncio.to_thread(cluster.hold, 12)
        step = [asyncio.create_task(complete(cluster, f"step-{i}", 300)) for i in range(12)]
        # placed by the router, then run by the engine: what the autoscaler samples
        await until(lambda: loads() == [12] and running() == [12])
        assert (await tick()).reason == "waiting_to_scale_up"
        assert (await tick(1.0)).reason == "over_target"
        await asyncio.to_thread(cluster.release)
        # the new replica's shard asks for a group of its own (here there is room for it)
        await until(lambda: created_groups() == groups_before + 2)
        # its engine is being built; nothing else is decided (the fake clock stands still:
        # ticks faster than real time would run out its start timeout on a busy machine)
        deadline = time.monotonic() + WAIT_S
        while autoscaler.starting:
            assert (await tick()).reason in ("starting", "within_band", "waiting_to_scale_down")
            assert time.monotonic() < deadline, "the new replica did not start"
            await asyncio.sleep(0.1)
        assert [(a.delta, a.replica) for a in autoscaler.history] == [(1, 1)]
        # serving: its rates count, so pulls between the two get priced
        assert list(cluster.measured_rates) == [0, 1]
        assert all(rates.prefill_tokens_per_s > 0 for rates in cluster.measured_rates.values())
        assert cluster.pull_bandwidth is not None and cluster.pull_bandwidth > 0
        outputs = await asyncio.gather(*step)
        # the lighter load, through the view: one request each (least-loaded: the second goes
        # where the first did not), and the new replica serves its share
        light = [asyncio.create_task(complete(view, f"light-{i}", 400)) for i in range(2)]
        await until(lambda: loads() == [1, 1] and running() == [1, 1])
        assert (await tick()).reason == "waiting_to_scale_down"
        drained = await tick(5.0)
        assert (drained.delta, drained.reason) == (-1, "under_target")
        action = autoscaler.history[-1]
        assert (action.replica, action.in_flight) == (1, 1)  # a tie: the newest drains
        assert (await tick(1.0)).reason == "draining"  # its request is still running
        # while it drains, a new request goes to the other one; its own request goes on
        late = await complete(cluster, "late", 4)
        outputs += await asyncio.gather(*light)
        assert 1 in cluster.replica_handles()  # removed at the next tick, not before
        drained_engine = ray.get(cluster.replicas[1].metrics.remote())
        assert drained_engine.finished_requests == {"length": 1}  # its light one, not "late"
        assert drained_engine.generation_tokens == 400
        await tick(1.0)  # its requests are done: it is removed
        assert cluster.replica_handles().keys() == {0}
        assert list(cluster.measured_rates) == [0]  # one replica again: nothing to pull
        assert ray.get(cluster.router.stats.remote()).removed == frozenset({1})
        assert created_groups() == groups_before + 1  # its group went with its shard
        assert late == (outputs[0][0][:4], "length")
        return outputs

    try:
        outputs = asyncio.run(scenario())
        # no request lost, and every one the same greedy output wherever it ran
        assert [reason for _, reason in outputs] == ["length"] * 14
        assert {tuple(tokens[:300]) for tokens, _ in outputs} == {tuple(outputs[0][0])}
        # none is asked of the removed one, by the owner or by the view
        assert len(asyncio.run(cluster.metrics())) == len(asyncio.run(view.metrics())) == 1
        assert len(view.replicas) == 1  # its list refreshed from the router
    finally:
        cluster.shutdown()
    assert not autoscaler._thread.is_alive()  # shutdown woke and ended its thread
