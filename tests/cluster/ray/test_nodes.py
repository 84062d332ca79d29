"""tandem over several Ray nodes of this machine: two replicas on two nodes behind one router,
and engine autoscaling that makes Ray's (fake) autoscaler start a GPU node and return it.

The scenario (tests/cluster/ray/nodes_scenario.py) runs in a process of its own, on a Ray
cluster of its own: this session's Ray instance is one node, and a process joins one cluster.
It starts as the session's collection ends and runs beside the other tests, on a loaded
machine (nodes_background.py). Every request's tokens are checked against the engine run in
this process.
"""

import json

import pytest

from cluster import LLM, SamplingParams
from tests.cluster.ray.nodes_background import SCENARIO

pytestmark = pytest.mark.ray


def scenario() -> dict:
    """The report of the scenario the collection hook started (tests/conftest.py)."""
    returncode, stderr = SCENARIO.wait(timeout_s=900)
    found = json.loads(SCENARIO.report.read_text()) if SCENARIO.report.exists() else {}
    # the scenario's own traceback and Ray's logs of it, not Ray's start-up chatter
    assert returncode == 0, "\n".join([(found.get("error") or stderr)[-2000:],
                                        found.get("ray_state", "")[-3000:],
                                        (found.get("ray_logs") or "")[-4000:]])
    return found


def test_replicas_on_two_nodes_and_a_gpu_node_that_comes_and_goes_with_the_load():
    report = scenario()
    print("scenario seconds:", report["seconds"])
    want = LLM(str(SCENARIO.model), device="cpu", block_size=4, num_kv_blocks=1024).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=508, ignore_eos=True)
    )[0].token_ids
    outputs = report["outputs"]

    def answers(max_tokens, count):
        return [[want[:max_tokens], "length"]] * count

    # two nodes (`ray start --head`, `ray start --address`): a replica's shard on each, and
    # each answered one of the two requests sent through the one router
    nodes = report["node_ids"]
    assert nodes.keys() == {"head", "b"} and nodes["head"] != nodes["b"]
    assert sorted(report["shard_nodes"]) == sorted([[nodes["head"]], [nodes["b"]]])
    assert report["finished_per_replica"] == [{"length": 1}, {"length": 1}]
    assert outputs["two"] == answers(16, 2)

    # the load step: a third replica, on a GPU node Ray's autoscaler started for it
    assert report["added_nodes"] == [{"CPU": 1.0, "GPU": 1.0}]
    assert report["new_shard_node"] == {"new": True, "CPU": 1.0, "GPU": 1.0}
    reasons = report["reasons"]
    assert reasons[:2] == ["waiting_to_scale_up", "over_target"]
    # while it started nothing else was decided; the tick that found it serving decided again
    starting, found_up = reasons[2:-4], reasons[-4]
    assert set(starting) <= {"starting"}
    assert found_up in ("within_band", "waiting_to_scale_down")
    assert outputs["step"] == answers(300, 12)
    assert outputs["during"] == answers(8, 3)  # sent while its node was coming
    # the light load: it drained with a request running there, which finished; then it went
    assert reasons[-3:] == ["waiting_to_scale_down", "under_target", "within_band"]
    assert report["history"] == [[1, "over_target", 2, 0], [-1, "under_target", 2, 1]]
    assert report["drained_finished"] == {"length": 1}
    assert outputs["light"] == answers(508, 3)
    assert outputs["late"] == answers(4, 1)  # sent while it drained
    assert report["replicas_after"] == [0, 1]  # and its GPU node went back (waited for)
