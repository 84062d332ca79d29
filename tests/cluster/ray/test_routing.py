"""Prefix-affinity routing on Ray: replicas' KV events reach the router's directory, which
sends a prefix where it is cached; dumps agree with the directory; salts keep tenants apart."""

import asyncio
import time

import pytest

from cluster import EngineConfig, SamplingParams
from cluster.ray.tandem_cluster import TandemCluster

pytestmark = pytest.mark.ray

PREFIX = list(range(100, 116))  # four blocks of 4


async def run(cluster, prompt, request_id, **params):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, **params)
    async for output in cluster.generate(prompt, params, request_id):
        last = output
    return last


def wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_prefix_goes_where_the_events_say_it_is_cached(ray_session, tiny_models):
    cluster = TandemCluster(EngineConfig(model=str(tiny_models["llama"]), device="cpu",
                                         block_size=4, num_kv_blocks=64), num_replicas=2)
    router = cluster.router
    try:
        asyncio.run(run(cluster, PREFIX + [7], "first"))
        # 17 prompt tokens and 2 of the 3 output tokens were computed: 4 full blocks
        wait_for(lambda: ray_session.get(router.stats.remote()).directory_blocks == 4)
        first = [s.prefix_cache_hits for s in asyncio.run(cluster.stats())]
        for index in range(3):
            asyncio.run(run(cluster, PREFIX + [9, index], f"later-{index}"))
        hits = [s.prefix_cache_hits - f for s, f in zip(asyncio.run(cluster.stats()), first,
                                                        strict=True)]
        assert sorted(hits) == [0, 3 * 16]  # every later request on the prefix's replica
        stats = ray_session.get(router.stats.remote())
        assert stats.decisions == {"no_match": 1, "affinity": 3}
        # another tenant's salt finds nothing: no affinity, and no hits where it lands
        before = sum(s.prefix_cache_hits for s in asyncio.run(cluster.stats()))
        asyncio.run(run(cluster, PREFIX + [9, 0], "salted", cache_salt="tenant-b"))
        assert sum(s.prefix_cache_hits for s in asyncio.run(cluster.stats())) == before
        assert ray_session.get(router.stats.remote()).decisions["no_match"] == 2
        # each replica's own dump is what the directory lists for it
        wait_for(lambda: ray_session.get(router.stats.remote()).blocks_held == [
            len(ray_session.get(r.dump_cache.remote()).hashes) for r in cluster.replicas])
        assert ray_session.get(router.get_loads.remote()) == [0, 0]
    finally:
        cluster.shutdown()


def test_a_router_that_lost_its_directory_resyncs_from_the_dumps(ray_session, tiny_models):
    cluster = TandemCluster(EngineConfig(model=str(tiny_models["llama"]), device="cpu",
                                         block_size=4, num_kv_blocks=64), num_replicas=2)
    try:
        asyncio.run(run(cluster, PREFIX + [7], "first"))
        wait_for(lambda: ray_session.get(cluster.router.stats.remote()).directory_blocks == 4)
        # a fresh router (as after a restart) sees the replicas' next batches out of sequence
        import ray

        from cluster.ray.router_actor import ROUTER_ACTOR_OPTIONS, RouterActor

        new_router = ray.remote(RouterActor).options(**ROUTER_ACTOR_OPTIONS).remote(2)
        for replica in cluster.replicas:
            ray.get(replica.set_router.remote(new_router))
        cluster.router = new_router
        asyncio.run(run(cluster, list(range(500, 508)) + [1], "other"))  # new events: a gap
        # the other prompt's 2 blocks (9 tokens + 2 computed outputs), and the dump's 4
        wait_for(lambda: ray.get(new_router.stats.remote()).directory_blocks == 6)
        assert ray.get(new_router.stats.remote()).resyncs == 1
        asyncio.run(run(cluster, PREFIX + [9], "later"))
        assert ray.get(new_router.stats.remote()).decisions.get("affinity") == 1
    finally:
        cluster.shutdown()
