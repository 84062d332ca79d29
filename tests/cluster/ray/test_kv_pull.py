"""Blocks pulled across replicas: a prefix cached on a replica that is busy is pulled from its
host tier, through Ray's object store, into the host tier of the replica the request runs on,
and the output is transformers' own."""

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import EngineConfig, SamplingParams
from cluster.ray.tandem_cluster import TandemCluster

pytestmark = pytest.mark.ray

PREFIX = list(range(100, 116))  # four blocks of 4
BLOCK_BYTES = 2048  # the tiny llama's block: 2 layers x K and V x 4 tokens x 2 heads x 16 x 4 B


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def run(cluster, prompt, request_id):
    async for output in cluster.generate(prompt, greedy(3), request_id):
        last = output
    return last


def wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_prefix_on_a_busy_replica_is_pulled_from_its_host_tier(ray_session, tiny_models):
    model = tiny_models["llama"]
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", block_size=4,
                          num_kv_blocks=64, host_kv_cache_gb=64 * BLOCK_BYTES / (1 << 30))
    cluster = TandemCluster(config, num_replicas=2)
    router = cluster.router
    try:
        asyncio.run(run(cluster, PREFIX + [7], "first"))  # on replica 0: nothing cached yet
        wait_for(lambda: ray_session.get(router.stats.remote()).directory_blocks == 4)

        async def pulled_while_replica_0_decodes():
            # the prefix's own replica is busy with another request of the prefix: it counts
            # as decoding there until its stream is closed, whether or not it has finished
            busy = cluster.generate(PREFIX + [8], greedy(8), "busy")
            await busy.__anext__()
            try:
                return await run(cluster, PREFIX + [9], "pulled")
            finally:
                await busy.aclose()

        output = asyncio.run(pulled_while_replica_0_decodes())
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        prompt = PREFIX + [9]
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert output.token_ids == expected[0, len(prompt):].tolist()
        stats = ray_session.get(router.stats.remote())
        assert stats.decisions == {"no_match": 1, "affinity": 1, "pull": 1}
        source, target = asyncio.run(cluster.stats())
        assert source.kv_exported_tokens == 16 and source.kv_pulled_tokens == 0
        # the four blocks came over, then loaded from the host tier like any host hit
        assert target.kv_pulled_tokens == 16
        assert (target.prefix_cache_hits, target.host_cache_hits) == (16, 16)
    finally:
        cluster.shutdown()
