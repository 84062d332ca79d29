"""Prefix-affinity routing on Ray: replicas' KV events reach the router's directory, which
sends a prefix where it is cached; dumps agree with the directory; salts keep tenants apart;
a prefix whose replica is busy is pulled from that replica's host tier, through Ray's object
store, to the replica the request runs on, with transformers' output, also once the holder's
device cache has lost it (the directory lists host-tier blocks too)."""

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import EngineConfig, SamplingParams
from cluster.ray.tandem_cluster import TandemCluster
from kvstore.block_hash import hash_full_blocks

pytestmark = pytest.mark.ray

PREFIX = list(range(100, 116))  # four blocks of 4
HOST_PREFIX = list(range(300, 316))  # four more, which replica 0's device cache loses
BLOCK_BYTES = 2048  # the tiny llama's block: 2 layers x K and V x 4 tokens x 2 heads x 16 x 4 B


async def run(cluster, prompt, request_id, **params):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, **params)
    async for output in cluster.generate(prompt, params, request_id):
        last = output
    return last


def wait_for(condition, seconds=120.0):  # generous: what Ray's processes do, on a busy machine
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_prefix_goes_where_the_events_say_it_is_cached(ray_session, tiny_models):
    # host tiers on, 4 times the device pool: the pulls at the end (one cluster for all: its
    # start is most of the cost)
    config = EngineConfig(model=str(tiny_models["llama"]), device="cpu", dtype="float32",
                          block_size=4, num_kv_blocks=16,
                          host_kv_cache_gb=64 * BLOCK_BYTES / (1 << 30))
    cluster = TandemCluster(config, num_replicas=2)
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
        pulled_while_the_holder_is_busy(cluster, tiny_models["llama"], ray_session)
        pulled_from_a_host_tier_alone(cluster, tiny_models["llama"], ray_session)
    finally:
        cluster.shutdown()


def pulled_while_the_holder_is_busy(cluster, model, ray_session):
    """Replica 0 holds the prefix and is busy with another request of it (counted as decoding
    there until its stream closes): the next one runs on replica 1, which pulls the four
    blocks from replica 0's host tier, then loads them like any host-tier hit."""
    before = asyncio.run(cluster.stats())
    output = asyncio.run(while_busy(cluster, PREFIX + [8], PREFIX + [9], "pulled"))
    assert output.token_ids == greedy_reference(model, PREFIX + [9])
    decisions = ray_session.get(cluster.router.stats.remote()).decisions
    assert (decisions["affinity"], decisions["pull"]) == (4, 1)  # busy, then pulled
    assert_pulled(before, asyncio.run(cluster.stats()), 16)


def pulled_from_a_host_tier_alone(cluster, model, ray_session):
    """Replica 0 computes another prefix, then a prompt of its whole device pool evicts that
    from its device cache; its host tier keeps it, and the directory says so. Busy again, it
    is pulled from as before."""
    asyncio.run(run(cluster, HOST_PREFIX + [7], "host-first"))  # both idle: on replica 0
    flush = list(range(500, 561))  # 61 tokens and 3 out: the device pool's 16 blocks
    asyncio.run(run(cluster, flush, "flush"))  # no match anywhere: on replica 0 again
    dump = ray_session.get(cluster.replicas[0].dump_cache.remote())
    block_size, extra_keys = cluster.kv_hash_keys
    hashes = hash_full_blocks(HOST_PREFIX, block_size, tuple(extra_keys))
    assert not set(hashes) & set(dump.hashes) and set(hashes) <= set(dump.host_hashes)

    def listed():  # what the directory lists for replica 0, in each tier
        stats = ray_session.get(cluster.router.stats.remote())
        return stats.blocks_held[0], stats.host_blocks_held[0]

    wait_for(lambda: listed() == (len(dump.hashes), len(dump.host_hashes)))
    before = asyncio.run(cluster.stats())
    output = asyncio.run(while_busy(cluster, flush[:32] + [5], HOST_PREFIX + [9],
                                    "host-pulled"))
    assert output.token_ids == greedy_reference(model, HOST_PREFIX + [9])
    decisions = ray_session.get(cluster.router.stats.remote()).decisions
    # host-first and flush matched nothing; busy went to its prefix, then the pull
    assert (decisions["no_match"], decisions["affinity"], decisions["pull"]) == (4, 5, 2)
    assert_pulled(before, asyncio.run(cluster.stats()), 16)


async def while_busy(cluster, busy_prompt, prompt, request_id):
    """``prompt``'s output, run while another request of ``busy_prompt`` decodes."""
    busy = cluster.generate(busy_prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                        ignore_eos=True), f"busy-{request_id}")
    await busy.__anext__()
    try:
        return await run(cluster, prompt, request_id)
    finally:
        await busy.aclose()


def greedy_reference(model, prompt):
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return expected[0, len(prompt):].tolist()


def assert_pulled(before, after, num_tokens):
    """Replica 1 pulled ``num_tokens`` from replica 0's host tier and loaded them."""
    (source, target), (source_0, target_0) = after, before
    assert source.kv_exported_tokens - source_0.kv_exported_tokens == num_tokens
    assert (target.kv_pulled_tokens - target_0.kv_pulled_tokens,
            target.host_cache_hits - target_0.host_cache_hits,
            target.prefix_cache_hits - target_0.prefix_cache_hits) == (num_tokens,) * 3
    assert source.kv_pulled_tokens == 0


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
