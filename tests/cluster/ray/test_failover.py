"""Faults on two replicas of a tiny model that has a real tokenizer: streams survive a killed
engine process with exactly a clean run's tokens and text, an idle shard's death is found by the
health check (no request needed), rebuilt and costs no counts, and a full queue refuses at once
(while the queue is still full, not once there is room)."""

import asyncio
import os
import signal
import time

import pytest

from cluster import EngineConfig, SamplingParams
from cluster.ray.refusals import Overloaded
from cluster.ray.serving_policy import ServingPolicy
from cluster.ray.tandem_cluster import TandemCluster
from tests.cluster.ray.held_replicas import HeldCluster
from tests.cluster.ray.test_ray_cluster import counts

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # slow: the default model's tokenizer

WAIT_S = 120  # for Ray's processes to die, restart and rebuild: generous on a busy machine

PROMPTS = [[504, 3060, 314, 4649, 314, 2887, 28, 260], [1780, 314, 260, 3523], [42, 43, 44]]
# greedy and seeded sampled requests, both of which must continue exactly
PARAMS = [SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=160, ignore_eos=True)]
REQUESTS = [(prompt, params) for prompt in PROMPTS for params in PARAMS]  # six


@pytest.fixture(scope="module")
def two_replicas(ray_session, tiny_chat_model):
    cluster = TandemCluster(EngineConfig(model=str(tiny_chat_model), device="cpu",
                                         block_size=4, num_kv_blocks=512),
                            num_replicas=2, routing="least-loaded",
                            policy=ServingPolicy(health_check_period_s=0.5))
    yield cluster
    cluster.shutdown()


async def run_all(cluster, tag: str, after_output=None) -> list[list]:
    """Every request's outputs, in the order they came; ``after_output(progress)`` is called
    with each stream's token count so far after each output."""
    progress = [0] * len(REQUESTS)

    async def one(index, prompt, params):
        outputs = []
        async for output in cluster.generate(prompt, params, f"{tag}-{index}"):
            outputs.append(output)
            progress[index] = len(output.token_ids)
            if after_output is not None:
                after_output(progress)
        return outputs

    return await asyncio.wait_for(asyncio.gather(
        *[one(i, prompt, params) for i, (prompt, params) in enumerate(REQUESTS)]), timeout=240)


def final(streams: list[list]) -> list[tuple]:
    return [(s[-1].token_ids, s[-1].text, s[-1].finish_reason) for s in streams]


def pid_of(ray_session, replica) -> int:
    return ray_session.get(replica.__ray_call__.remote(lambda self: os.getpid()))


def test_every_stream_survives_a_replica_process_killed_mid_stream(ray_session, two_replicas):
    cluster = two_replicas
    clean = asyncio.run(run_all(cluster, "clean"))
    assert all(len(text) > 100 for _, text, _ in final(clean))
    before = asyncio.run(cluster.metrics())
    pid = pid_of(ray_session, cluster.replicas[0])
    killed = []

    def kill_once_all_started(progress):
        if not killed and min(progress) >= 3:
            os.kill(pid, signal.SIGKILL)
            killed.append(list(progress))

    survived = asyncio.run(run_all(cluster, "killed", kill_once_all_started))
    assert killed and max(killed[0]) < 160  # every stream was mid-way
    assert final(survived) == final(clean)
    for outputs in survived:  # one unbroken stream each: text only grows
        texts = [o.text for o in outputs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    # least-loaded put three of the six on replica 0: each moved once
    assert asyncio.run(cluster.router_stats()).failovers == 3
    assert ray_session.get(cluster.router.get_loads.remote()) == [0, 0]
    # requests after it succeed, on both replicas once the dead one is back
    deadline = time.monotonic() + WAIT_S
    while asyncio.run(cluster.health()).status != "ok":
        assert time.monotonic() < deadline, "replica 0 did not come back"
        time.sleep(0.2)
    assert pid_of(ray_session, cluster.replicas[0]) != pid
    again = asyncio.run(run_all(cluster, "after"))
    assert final(again) == final(clean)
    after = asyncio.run(cluster.metrics())
    for old, new in zip(before, after, strict=True):  # the dead process's counts stay
        assert all(counts(new).get(k, 0) >= v for k, v in counts(old).items())


def test_a_shard_killed_while_idle_is_found_by_the_health_check_and_rebuilt(ray_session,
                                                                             two_replicas):
    cluster = two_replicas
    before = asyncio.run(cluster.metrics())
    failovers = asyncio.run(cluster.router_stats()).failovers  # the test before's
    [shard] = ray_session.get(cluster.replicas[1].shard_pids.remote())
    os.kill(shard, signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S  # no request is sent: only the health check finds it
    statuses = []
    while not statuses or statuses[-1] != "degraded":
        assert time.monotonic() < deadline, statuses
        statuses.append(asyncio.run(cluster.health()).status)
        time.sleep(0.1)
    while statuses[-1] != "ok":  # it rebuilt itself, with no request to find it broken
        assert time.monotonic() < deadline, statuses
        statuses.append(asyncio.run(cluster.health()).status)
        time.sleep(0.2)
    assert ray_session.get(cluster.replicas[1].shard_pids.remote()) != [shard]
    # nothing ran meanwhile: the rebuilt replica's counts are exactly the old engine's
    after = asyncio.run(cluster.metrics())
    assert [counts(s) for s in after] == [counts(s) for s in before]
    # none: nothing was in flight
    assert asyncio.run(cluster.router_stats()).failovers == failovers


def test_past_the_waiting_limit_a_request_is_refused_at_once(ray_session, tiny_models):
    # held (held_replicas.py): once the running request has its first token the engine stops
    # stepping, so it cannot finish and let the queue drain before the refusal is seen
    cluster = HeldCluster(EngineConfig(model=str(tiny_models["llama"]), device="cpu",
                                       block_size=4, num_kv_blocks=256, max_num_seqs=1),
                          num_replicas=1,
                          policy=ServingPolicy(max_waiting_requests=2, retry_after_s=3))
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=8)

    async def last(prompt, params, request_id):
        return [out async for out in cluster.generate(prompt, params, request_id)][-1]

    async def loads():
        return (await cluster.router_stats()).loads[0]

    async def scenario():
        running = cluster.generate([1, 2, 3], long, "running")
        await anext(running)  # its first token: it no longer waits
        # the router hears of that token by a call of its own, which its asyncio actor may run
        # after a later placement: until it has, the running request still counts as waiting
        # and the second queued one would be the one refused
        while (await loads()).num_prefilling:
            await asyncio.sleep(0.01)
        queued = [asyncio.create_task(last([4, 5, i], short, f"queued-{i}")) for i in range(2)]
        while (await loads()).num_prefilling < 2:  # one sequence at a time: these two wait
            done = [task for task in queued if task.done()]
            assert not done, f"a queued request ended before the refusal: {done[0].exception()!r}"
            await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as refused:
            await last([6, 7], short, "refused")
        # at once: refused while the queue was still full (the two still wait behind the
        # running one), not once it had room
        waiting_then = (await loads()).num_prefilling, [task.done() for task in queued]
        cluster.release()
        await running.aclose()  # the client leaves: its abort lets the queued two run
        return waiting_then, refused.value, await asyncio.gather(*queued)

    try:
        cluster.hold(1)  # steps until the one running sequence has a token, then none
        waiting_then, refusal, queued = asyncio.run(asyncio.wait_for(scenario(),
                                                                     timeout=WAIT_S))
        assert waiting_then == (2, [False, False]) and refusal.retry_after_s == 3
        assert str(refusal) == ("The server is overloaded (every engine replica's queue is "
                                "full): retry the request later.")
        assert [(len(o.token_ids), o.finish_reason) for o in queued] == [(8, "length")] * 2
        stats = asyncio.run(cluster.router_stats())
        assert stats.rejected == {"overloaded": 1} and stats.loads[0].num_requests == 0
        assert len(asyncio.run(last([6, 7], short, "later")).token_ids) == 8  # room again
    finally:
        cluster.shutdown()
