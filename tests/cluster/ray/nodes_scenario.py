"""tandem on a Ray cluster of several nodes on this machine, in a process of its own: the test
session has its one Ray instance, and a process joins one Ray cluster only. Run by
tests/cluster/ray/test_nodes.py, which asserts what this writes:

    python -m tests.cluster.ray.nodes_scenario MODEL_FOLDER REPORT.json

The head has one CPU and runs Ray's fake autoscaler, whose one node type is a fake GPU node of
one CPU; each replica's shard takes a CPU (cpu_shard_cpus=1).

1. Two nodes: `ray start --address` adds a node of one CPU; two replicas, one shard on each
   node, answer through one cluster handle (one router).
2. Autoscaling: a load step makes tandem's autoscaler start a third replica, whose placement
   group fits on neither node: Ray's autoscaler starts a GPU node for it. Requests keep
   succeeding meanwhile. A light load makes it drain that replica while a request runs there,
   which finishes; then the replica goes, and Ray's autoscaler returns the idle node.
   tandem's autoscaler ticks on a fake clock (its delays pass at once); Ray's runs on its own,
   every second.
"""

import asyncio
import json
import signal
import sys
import time
import traceback

import ray

from cluster import EngineConfig, SamplingParams
from cluster.ray.tandem_cluster import TandemCluster
from router.autoscale import AutoscalingPolicy
from tests.cluster.ray.held_replicas import HeldCluster
from tests.cluster.ray.local_nodes import LocalNodes, wait_for

PROMPT = [5, 6, 7, 8]
LONGEST = 508  # tokens: the prompt and these fill the tiny model's 512 positions
IDLE_NODE_TIMEOUT_S = 10.0
GPU_NODE = {"resources": {"CPU": 1, "GPU": 1}, "min_workers": 0, "max_workers": 1}
# 12 sequences running on 2 replicas are 1.5x a target of 4; one on each of 3 replicas is
# 0.25, which 2 replicas would carry at 0.375: under the band, so the cluster shrinks while
# all three still serve
POLICY = AutoscalingPolicy(min_replicas=2, max_replicas=3, target_running_seqs=4,
                           target_waiting_prompt_tokens=10**6, target_kv_usage=1.0,
                           upscale_delay_s=1, downscale_delay_s=5, interval_s=3600)


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


async def complete(cluster: TandemCluster, request_id: str, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async for output in cluster.generate(PROMPT, params, request_id):
        last = output
    return last.outputs[0].token_ids, last.outputs[0].finish_reason


class Ticks:
    """tandem's autoscaler on a fake clock: each tick where the scenario has set it up."""

    def __init__(self, cluster: TandemCluster) -> None:
        assert cluster.autoscaler is not None
        self.autoscaler, self.now = cluster.autoscaler, 0.0
        self.autoscaler.clock = lambda: self.now
        self.reasons: list[str] = []

    async def __call__(self, seconds: float = 0.0) -> str:
        self.now += seconds
        decision = await asyncio.to_thread(self.autoscaler.tick)
        self.reasons.append(decision.reason)
        return decision.reason


async def until(condition, seconds: float, what: str) -> None:
    await asyncio.to_thread(wait_for, condition, seconds, what, 0.05)


async def autoscaling(cluster: HeldCluster, report: dict) -> dict:
    tick, outputs = Ticks(cluster), {}

    def running() -> list[int]:
        """Sequences each serving replica runs, as the autoscaler samples them: a tick comes
        once the engines run what the router placed."""
        handles = cluster.replica_handles()
        return [sample.running_seqs for sample in ray.get(
            [handles[index].load_sample.remote() for index in tick.autoscaler.serving()])]

    def loads() -> list[int]:
        return [load.num_requests for load in ray.get(cluster.router.stats.remote()).loads]

    # held until the ticks have seen it (held_replicas.py): six running on each replica
    await asyncio.to_thread(cluster.hold, 6)
    step = [asyncio.create_task(complete(cluster, f"step-{i}", 300)) for i in range(12)]
    await until(lambda: running() == [6, 6], 180, "the load step on replicas 0 and 1")
    await tick()
    # the nodes before replica 2 asks for one: Ray's autoscaler may add it at once
    before = {node["NodeID"] for node in alive_nodes()}
    await tick(1.0)  # over target for the upscale delay: replica 2 starts
    await asyncio.to_thread(cluster.release)
    # requests sent meanwhile are served by the others: placed and done long before replica
    # 2 can serve (its node has yet to start, then its shard's process)
    outputs["during"] = await asyncio.gather(*[complete(cluster, f"during-{i}", 8)
                                               for i in range(3)])
    # its group fits on neither node: Ray's autoscaler starts a GPU node for it
    added = await asyncio.to_thread(wait_for, lambda: [
        node for node in alive_nodes() if node["NodeID"] not in before], 180, "a GPU node")
    report["added_nodes"] = [{key: node["Resources"][key] for key in ("CPU", "GPU")}
                             for node in added]
    # nothing else is decided while it starts; the fake clock stands still meanwhile, or
    # ticks faster than real time would run out its start timeout on a busy machine
    while tick.autoscaler.starting:
        await tick()
        await asyncio.sleep(0.2)
    # on the node Ray started for it (on a busy machine Ray may have replaced its first try)
    [shard_node] = ray.get(cluster.replicas[2].shard_nodes.remote())
    node = {node["NodeID"]: node for node in alive_nodes()}[shard_node]
    report["new_shard_node"] = {"new": shard_node not in before,
                                **{key: node["Resources"][key] for key in ("CPU", "GPU")}}
    outputs["step"] = await asyncio.gather(*step)
    # the wish to shrink begins while nothing runs
    await tick()
    finished = [ray.get(r.metrics.remote()).finished_requests for r in cluster.replicas]
    # the light load: one long request on each replica (least-loaded), held running there
    # until the drain has begun (a tie of one request each: the newest replica drains)
    await asyncio.to_thread(cluster.hold, 1)
    light = [asyncio.create_task(complete(cluster, f"light-{i}", LONGEST)) for i in range(3)]
    await until(lambda: loads() == [1, 1, 1] and running() == [1, 1, 1], 180,
                "one request running on each replica")
    await tick(5.0)  # under target for the downscale delay: replica 2 drains
    await asyncio.to_thread(cluster.release)
    outputs["late"] = [await complete(cluster, "late", 4)]  # goes to another
    outputs["light"] = await asyncio.gather(*light)
    # no tick until its request is done, so it is still there to ask: what it finished
    # since the light load came
    drained = ray.get(cluster.replicas[2].metrics.remote()).finished_requests
    report["drained_finished"] = {reason: count - finished[2].get(reason, 0)
                                  for reason, count in drained.items()}
    await tick(1.0)  # its requests are done: it is removed
    report["history"] = [[a.delta, a.reason, a.replica, a.in_flight]
                         for a in tick.autoscaler.history]
    report["replicas_after"] = sorted(cluster.replica_handles())
    # the idle GPU node goes back after Ray's idle timeout
    await until(lambda: len(alive_nodes()) == 2, 180, "the idle GPU node's return")
    report["reasons"] = tick.reasons
    return outputs


async def two_nodes(cluster: TandemCluster, report: dict) -> dict:
    answers = await asyncio.gather(*[complete(cluster, f"two-{i}", 16) for i in range(2)])
    report["shard_nodes"] = [ray.get(r.shard_nodes.remote()) for r in cluster.replicas]
    report["finished_per_replica"] = [ray.get(r.metrics.remote()).finished_requests
                                      for r in cluster.replicas]
    return {"two": answers}


def ray_state() -> str:
    """What a failed wait needs to be read: tandem's actors and the placement groups, each
    with its state (a replica that never asked for its group, or a group that waits)."""
    if not ray.is_initialized():
        return "(not connected)"
    try:
        from ray.util.state import list_actors

        actors = [f"{a.class_name} {a.state} {a.node_id} {a.death_cause or ''}"[:300]
                  for a in list_actors(limit=100)]
        groups = [f"{g['state']} {g['bundles']}" for g in
                  ray.util.placement_group_table().values()]
        return "\n".join(["actors:", *actors, "placement groups:", *groups])
    except Exception as error:  # a report without it still says what failed
        return f"(state unavailable: {error!r})"


def timed(report: dict, name: str, since: float) -> float:
    now = time.monotonic()
    report["seconds"][name] = round(now - since, 1)
    return now


def main(model: str, out: str) -> None:
    config = EngineConfig(model=model, device="cpu", block_size=4, num_kv_blocks=1024,
                          cpu_shard_cpus=1.0)
    report: dict = {"seconds": {}, "outputs": {}}
    nodes = LocalNodes()
    start = time.monotonic()
    try:
        # a GPU node idle this long goes back: long enough that on a busy machine the node
        # Ray starts for the third replica is not returned before its group lands there
        nodes.start_head(num_cpus=1, worker_types={"gpu": GPU_NODE},
                         idle_timeout_s=IDLE_NODE_TIMEOUT_S)
        nodes.add_node(num_cpus=1, resources={"node_b": 1})  # both start at once
        nodes.connect()
        # both CPUs there before two replicas ask for them, so neither group waits and Ray's
        # autoscaler adds no node
        wait_for(lambda: ray.available_resources().get("CPU") == 2, 180, "the second node")
        report["node_ids"] = {("b" if "node_b" in n["Resources"] else "head"): n["NodeID"]
                              for n in alive_nodes()}
        start = timed(report, "nodes", start)
        cluster = HeldCluster(config, num_replicas=2, routing="least-loaded",
                                autoscaling=POLICY)
        try:
            report["outputs"].update(asyncio.run(two_nodes(cluster, report)))
            start = timed(report, "two_nodes", start)
            report["outputs"].update(asyncio.run(autoscaling(cluster, report)))
            start = timed(report, "autoscaling", start)
        finally:
            cluster.shutdown()
    except BaseException:
        report["error"] = traceback.format_exc()
        report["ray_state"] = ray_state()
        report["ray_logs"] = nodes.log_tail()
        raise
    finally:
        ray.shutdown()
        nodes.stop()
        timed(report, "stop", start)
        with open(out, "w") as file:
            json.dump(report, file)


if __name__ == "__main__":
    # stopped early (the test session ended first): the finally above stops the nodes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    main(sys.argv[1], sys.argv[2])
