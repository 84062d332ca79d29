"""Routing end to end over HTTP: two replicas of a tiny random model (the default model's
tokenizer: what is routed is prompt blocks, whatever the weights), W4-style groups (a shared
prefix, different questions). With prefix affinity the groups' later requests find their
prefix cached. Round-robin beside it, over two replicas, computes each prefix twice
(tests/cluster/bench/test_prefix_bench.py, exact); the policies themselves, least-loaded too,
are tested in-process (tests/router/test_placement.py)."""

import asyncio
import socket
import time

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from cluster.serve.app import server_app
from cluster.serve.config import ServeConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny-chat"  # the served name
NUM_GROUPS, LATER, PREFIX_LEN, BLOCK = 6, 3, 160, 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefix(group: int) -> list[int]:
    return [1000 + (group * 7919 + i * 104729) % 40000 for i in range(PREFIX_LEN)]


async def complete(client: httpx.AsyncClient, route: str, prompt: list[int]) -> None:
    response = await client.post(f"/{route}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text


async def metric(client: httpx.AsyncClient, route: str, name: str) -> float:
    """The sum of ``name``'s samples on the app's /metrics (over replicas, say)."""
    text = (await client.get(f"/{route}/metrics")).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


async def prefix_hits(client: httpx.AsyncClient, route: str) -> float:
    return await metric(client, route, "tandem:prefix_cache_hits_total")


async def wait_until_the_router_knows_the_prefixes(client: httpx.AsyncClient, route: str,
                                                   timeout_s: float = 120.0) -> None:
    """The replicas push their KV events to the router without waiting: polled until its
    directory lists every group's prefix blocks (distinct prompts: one hash each) and it
    counts none of the first requests in flight, however busy the machine."""
    want = NUM_GROUPS * PREFIX_LEN // BLOCK
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = await metric(client, route, "tandem:kv_directory_blocks")
        in_flight = await metric(client, route, "tandem:router_requests_in_flight")
        if blocks >= want and in_flight == 0:
            return
        assert time.monotonic() < deadline, (
            f"{route}: the router's directory lists {blocks:g} of the prefixes' {want} blocks "
            f"and {in_flight:g} requests in flight after {timeout_s} s")
        await asyncio.sleep(0.1)


async def later_hit_share(base_url: str, route: str) -> float:
    """Share of the ideal prefix tokens the later requests found cached."""
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        await asyncio.gather(*[complete(client, route, prefix(g) + [5, g]) for g in
                               range(NUM_GROUPS)])
        await wait_until_the_router_knows_the_prefixes(client, route)
        before = await prefix_hits(client, route)
        # group by group, all at once: without affinity each group splits over both replicas
        await asyncio.gather(*[complete(client, route, prefix(g) + [6, g, i])
                               for g in range(NUM_GROUPS) for i in range(LATER)])
        found = await prefix_hits(client, route) - before
    return found / (NUM_GROUPS * LATER * PREFIX_LEN)


def test_prefix_affinity_finds_the_groups_prefixes(ray_session, tiny_chat_model):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    routing = "prefix-affinity"
    try:
        serve.run(server_app(ServeConfig(
            model=str(tiny_chat_model), served_model_name=MODEL, device="cpu",
            dtype="float32", num_replicas=2, num_kv_blocks=320, max_model_len=256,
            routing=routing, api_key=None)), name=routing, route_prefix=f"/{routing}")
        share = asyncio.run(later_hit_share(f"http://127.0.0.1:{port}", routing))
    finally:
        serve.shutdown()
    print("later requests' share of the ideal prefix tokens found cached:", share)
    assert share >= 0.9
