"""`tandem bench prefix`: W4 end to end on tiny models, on one replica and on two over Ray."""

import json

import pytest

from cluster.cli.main import main

# 3 groups x 4 requests, a 32-token prefix (8 blocks of 4) and an 8-token question
SHAPE = ["--num-groups", "3", "--group-size", "4", "--prefix-len", "32", "--question-len", "8",
         "--output-len", "4", "--block-size", "4", "--device", "cpu", "--no-hf"]
IDEAL = 3 * 32 + 12 * 8  # each prefix once, every question


def test_one_replica_computes_each_prefix_once_in_any_arrival_order(tiny_models, tmp_path):
    output = tmp_path / "w4.json"
    assert main(["bench", "prefix", "--model", str(tiny_models["llama"]), *SHAPE,
                 "--interleaved", "--num-kv-blocks", "128", "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    assert record["cache_on"]["prompt_tokens"] == 12 * 40
    assert record["cache_on"]["prompt_tokens_computed"] == IDEAL
    assert record["cache_off"]["prompt_tokens_computed"] == 12 * 40
    assert record["summary"]["computed_over_ideal"] == 1.0


@pytest.mark.ray
def test_two_replicas_with_prefix_affinity_compute_the_ideal(ray_session, tiny_models, tmp_path):
    output = tmp_path / "w4-replicas.json"
    # prefix affinity alone: a second routing starts two more replicas (~35 s of the suite's
    # 2-core time); round-robin's placement is tested in tests/router/test_placement.py and
    # over Ray in tests/cluster/ray/test_ray_cluster.py
    assert main(["bench", "prefix", "--model", str(tiny_models["llama"]), *SHAPE,
                 "--replicas", "2", "--routing", "prefix-affinity",
                 "--num-kv-blocks", "128", "--output", str(output)]) == 0
    results = json.loads(output.read_text())["results"]
    assert list(results) == ["prefix-affinity"]
    assert results["prefix-affinity"]["prompt_tokens_computed"] == IDEAL
