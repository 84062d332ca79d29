"""The distributed pieces on the CPU: TP shards over gloo, replicas, the router, faults."""

import asyncio
import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, EngineConfig, SamplingParams
from cluster.bench.process_cpu import cpu_seconds
from cluster.ray.replica import PARK_AFTER_S
from cluster.ray.serving_policy import ServingPolicy
from cluster.ray.tandem_cluster import TandemCluster
from router.placement import Decision

pytestmark = pytest.mark.ray

WAIT_S = 120  # for what Ray's processes do in their own time: generous on a busy machine

PROMPTS = [list(range(30, 52)), [9, 8, 7], [400, 401, 402, 403, 404, 405]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def hf_greedy(folder, prompts, max_tokens=12):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in prompts]


# vocabularies 1001 and 1003: odd; decode_steps 3 hands sampled tokens to rank 1 by broadcast,
# and with the lookahead step every rank keeps its tokens for the next call; one step a call
# with async scheduling: each call returns the step before's tokens, which rank 0 broadcast
# on the device for the next step's inputs
@pytest.mark.parametrize(("name", "decode_steps"), [("llama", 1), ("qwen3", 3)])
def test_tensor_parallel_2_over_ray_matches_transformers(ray_session, tiny_models, name,
                                                         decode_steps):
    llm = LLM(str(tiny_models[name]), device="cpu", block_size=4, num_kv_blocks=64,
              tensor_parallel_size=2, distributed_executor_backend="ray",
              decode_steps=decode_steps, decode_lookahead=decode_steps > 1,
              async_scheduling=decode_steps == 1)
    try:
        deferred = []
        execute = llm.engine.executor.execute
        llm.engine.executor.execute = lambda step: deferred.append(step.defer_read) or execute(
            step)
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [out.token_ids for out in outputs] == hf_greedy(tiny_models[name], PROMPTS)
        assert (sum(deferred) >= GREEDY.max_tokens) == (decode_steps == 1)
        assert len(set(llm.engine.executor.shard_pids())) == 2
        # every rank's profile of a request: its steps' all-reduces and matmuls are in it
        tables = llm.engine.executor.profile(lambda: llm.generate(PROMPTS[:1], GREEDY))
        assert len(tables) == 2
        assert all("gloo:all_reduce" in table and "aten::mm" in table for table in tables)
    finally:
        llm.engine.shutdown()


def test_tensor_parallel_2_shards_hold_int8_kv_and_give_tensor_parallel_1_s_tokens(
        ray_session, tiny_models):
    """kv_cache_dtype reaches each shard actor: every rank quantizes its own kv heads, each
    head's scale its own, so the shards' blocks are TP 1's split by head."""
    options = dict(device="cpu", block_size=4, num_kv_blocks=64)
    folder = str(tiny_models["llama"])
    want = [out.token_ids for out in LLM(folder, kv_cache_dtype="int8", **options).generate(
        PROMPTS, GREEDY)]
    # on this tiny model int8 KV changes greedy tokens: equal ones mean the shards quantize
    assert want != [out.token_ids for out in LLM(folder, **options).generate(PROMPTS, GREEDY)]
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
              kv_cache_dtype="int8", **options)
    try:
        assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.engine.shutdown()


async def stream(cluster, prompt, request_id, params=GREEDY):
    """Collects a streamed request: the final output and how many snapshots came."""
    count, last = 0, None
    async for output in cluster.generate(prompt, params, request_id):
        count, last = count + 1, output
    return last, count


def test_two_replicas_serve_concurrent_streams(ray_session, tiny_models):
    folder = tiny_models["llama"]
    cluster = TandemCluster(EngineConfig(model=str(folder), device="cpu", block_size=4,
                                         num_kv_blocks=64), num_replicas=2,
                            routing="least-loaded")
    try:
        prompts = PROMPTS * 4

        async def run_all():
            return await asyncio.gather(*[stream(cluster, p, f"r{i}")
                                          for i, p in enumerate(prompts)])

        results = asyncio.run(run_all())
        expected = hf_greedy(folder, PROMPTS)
        assert [out.token_ids for out, _ in results] == expected * 4
        # at most one output per token: steps that queued up while the caller was busy merge
        assert all(out.finished and 1 <= count <= 12 for out, count in results)
        stats = asyncio.run(cluster.stats())
        # least-loaded placement spread the 12 requests over both replicas
        assert [s.prefix_cache_queries > 0 for s in stats] == [True, True]
        assert [s.kv_blocks_used for s in stats] == [0, 0]
        assert_idle_shards_park_and_serve_again(cluster, ray_session, expected)
    finally:
        cluster.shutdown()


def assert_idle_shards_park_and_serve_again(cluster, ray, expected) -> None:
    """Idle shards wait on an event, not by polling their compiled graph's channel (which
    took ~0.9 s of CPU a second each); the next requests unpark them, same tokens."""
    pids = [pid for r in cluster.replicas for pid in ray.get(r.shard_pids.remote())]
    # each replica parks its shards once idle for PARK_AFTER_S, in its own time
    deadline = time.monotonic() + WAIT_S
    while not all(ray.get([r.__ray_call__.remote(lambda self: self.engine.executor.parked
                                                 is not None) for r in cluster.replicas])):
        assert time.monotonic() < deadline, f"not parked {WAIT_S} s after {PARK_AFTER_S} s idle"
        time.sleep(0.1)
    # parked, they use next to no CPU: measured over 2 s windows, until one shows it (a
    # window may catch the last of a step, or a burst of Ray's own threads)
    while True:
        before = [cpu_seconds(pid) for pid in pids]
        time.sleep(2.0)
        used = [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
        if all(u < 0.2 for u in used):  # health pings and Ray's own threads only
            break
        assert time.monotonic() < deadline, used

    async def run_again():
        return await asyncio.gather(*[stream(cluster, p, f"again{i}")
                                      for i, p in enumerate(PROMPTS * 2)])

    assert [out.token_ids for out, _ in asyncio.run(run_again())] == expected * 2


def counts(snapshot) -> dict[str, float]:
    """A snapshot's counters and histogram counts, by name: what must never go backwards."""
    from cluster.engine.metrics import COUNTER_FIELDS, HISTOGRAM_FIELDS

    values: dict[str, float] = {}
    for name in COUNTER_FIELDS:
        value = getattr(snapshot, name)
        items = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, tuple) else [("", value)]
        values.update({f"{name}[{key}]": v for key, v in items})
    for name in HISTOGRAM_FIELDS:
        histogram = getattr(snapshot, name)
        values.update({f"{name}.count": histogram.count, f"{name}.total": histogram.total})
        values.update({f"{name}[{i}]": c for i, c in enumerate(histogram.counts)})
    return values


def never_lower(before, after) -> None:
    for old, new in zip(before, after, strict=True):
        old_counts, new_counts = counts(old), counts(new)
        lower = {k: (v, new_counts.get(k, 0)) for k, v in old_counts.items()
                 if new_counts.get(k, 0) < v}
        assert not lower, lower


def wait_for_health(cluster, status: str, within_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + within_s
    while (seen := asyncio.run(cluster.health()).status) != status:
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)


def test_a_dead_shard_mid_stream_continues_on_the_rebuilt_replica(ray_session, tiny_models):
    """One replica (no other to take over): the stream waits for its replica to rebuild and
    goes on from the tokens it had, exactly as greedy would have gone."""
    folder = tiny_models["qwen3"]
    cluster = TandemCluster(EngineConfig(model=str(folder), device="cpu", block_size=4,
                                         num_kv_blocks=128, tensor_parallel_size=2),
                            num_replicas=1)
    try:
        pids = ray_session.get(cluster.replicas[0].shard_pids.remote())
        asyncio.run(stream(cluster, PROMPTS[1], "warm"))
        before = asyncio.run(cluster.metrics())
        long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

        async def killed_mid_stream():
            killed, seen = False, []
            async for output in cluster.generate(PROMPTS[0], long, "victim"):
                seen.append(list(output.token_ids))
                # >=, not ==: a stream that falls behind sends its backlog as one output
                if len(output.token_ids) >= 3 and not killed:
                    os.kill(pids[1], signal.SIGKILL)
                    killed = True
            return seen

        seen = asyncio.run(asyncio.wait_for(killed_mid_stream(), timeout=120))
        assert seen[-1] == hf_greedy(folder, PROMPTS[:1], max_tokens=60)[0]
        # one unbroken stream: every output extends the one before
        assert all(later[:len(earlier)] == earlier
                   for earlier, later in zip(seen, seen[1:], strict=False))
        new_pids = ray_session.get(cluster.replicas[0].shard_pids.remote())
        assert not set(new_pids) & set(pids)
        assert asyncio.run(cluster.router_stats()).failovers == 1
        wait_for_health(cluster, "ok")  # the health check's next round sees it whole
        # the rebuilt engine's counts are added to the old one's, never restarted
        after = asyncio.run(cluster.metrics())
        never_lower(before, after)
        assert after[0].finished_requests["length"] == before[0].finished_requests["length"] + 1
    finally:
        cluster.shutdown()


def test_a_dead_replica_process_mid_stream_continues_after_its_restart(ray_session,
                                                                        tiny_models):
    """The replica actor's process dies mid-stream and there is no other replica: the request
    retries until Ray has restarted it, then continues exactly; the router forgets nothing and
    the counters of the dead process stay counted."""
    folder = tiny_models["llama"]
    # the restart waited for as long as the test's own limit: on a busy 2-core machine Ray's
    # restart of the process (torch and the model loaded again) has taken over the 30 s default
    cluster = TandemCluster(EngineConfig(model=str(folder), device="cpu", block_size=4,
                                         num_kv_blocks=64), num_replicas=1,
                            policy=ServingPolicy(failover_timeout_s=170.0))
    try:
        replica = cluster.replicas[0]
        pid = ray_session.get(replica.__ray_call__.remote(lambda self: os.getpid()))
        asyncio.run(stream(cluster, PROMPTS[1], "warm"))
        before = asyncio.run(cluster.metrics())
        long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

        async def kill_mid_stream():
            out, killed = None, False
            async for out in cluster.generate(PROMPTS[0], long, "victim"):
                if len(out.token_ids) >= 2 and not killed:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            return out

        out = asyncio.run(asyncio.wait_for(kill_mid_stream(), timeout=180))
        assert out.token_ids == hf_greedy(folder, PROMPTS[:1], max_tokens=60)[0]
        assert out.finish_reason == "length"
        assert ray_session.get(cluster.router.get_loads.remote()) == [0]
        assert asyncio.run(cluster.router_stats()).failovers >= 1
        assert ray_session.get(replica.__ray_call__.remote(lambda self: os.getpid())) != pid
        never_lower(before, asyncio.run(cluster.metrics()))
    finally:
        cluster.shutdown()


def delta(request_id: str, token: int, last: int):
    from cluster.engine.outputs import CompletionDelta, RequestDelta, RequestMetrics

    return RequestDelta(request_id, [CompletionDelta(0, [token], "", None,
                                                     "length" if token == last else None, None)],
                        RequestMetrics(arrival_time=0.0), finished=token == last,
                        prompt_token_ids=[1, 2] if token == 1 else None)


class BurstReplica:
    """A replica that streams a request's tokens 1..5, one message each: the first alone, then,
    once the consumer asks (``send_the_rest``), the other four at once."""

    def __init__(self):
        self.queues, self.tasks = {}, []
        self.rest = asyncio.Event()

    async def send_the_rest(self):
        self.rest.set()

    async def subscribe(self, consumer_id):
        queue = self.queues.setdefault(consumer_id, asyncio.Queue())
        while True:
            yield await queue.get()

    async def submit(self, request_id, prompt_ids, params, consumer_id, resume=None,
                     wait_s=None, pull=None):
        queue = self.queues.setdefault(consumer_id, asyncio.Queue())

        async def produce():
            queue.put_nowait([(request_id, delta(request_id, 1, 5))])
            await self.rest.wait()
            for token in range(2, 6):
                queue.put_nowait([(request_id, delta(request_id, token, 5))])

        self.tasks.append(asyncio.get_running_loop().create_task(produce()))

    async def abort(self, request_id):
        return None


class OneReplicaRouter:
    async def assign(self, request_id, block_hashes, num_prompt_tokens, block_size, exclude=(),
                     resumed=False):
        return Decision(0, "round_robin")

    async def first_token(self, request_id):
        return None

    async def release(self, request_id):
        return None


def test_a_consumer_that_falls_behind_gets_the_backlog_as_one_output(ray_session):
    import ray

    from cluster.ray.tandem_cluster import ClusterHandles

    replica = ray.remote(BurstReplica).remote()
    handles = ClusterHandles([replica], ray.remote(OneReplicaRouter).remote(), "unused", 64,
                             (16, ("m",)))
    cluster = TandemCluster.attach(handles)

    async def backlog(request_id: str, count: int) -> None:
        """Waits until ``count`` deltas of the request wait in this process, not yet taken."""
        deadline = time.monotonic() + WAIT_S
        while cluster._streams[0].queues[request_id].qsize() < count:
            assert time.monotonic() < deadline, cluster._streams[0].queues[request_id].qsize()
            await asyncio.sleep(0.01)

    async def consume_slowly():
        outputs = []
        async for output in cluster.generate([1, 2], GREEDY, "slow"):
            outputs.append(output.outputs[0].token_ids)
            if len(outputs) == 1:  # busy with the first while the other four arrive
                await replica.send_the_rest.remote()
                await backlog("slow", 4)
        return outputs

    assert asyncio.run(consume_slowly()) == [[1], [1, 2, 3, 4, 5]]
