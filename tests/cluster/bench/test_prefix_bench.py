"""`tandem bench prefix`: W4 end to end on tiny models, on one replica and on two over Ray."""

import argparse
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


TIERS = ["--num-groups", "8", "--group-size", "2", "--prefix-len", "32", "--question-len", "8",
         "--output-len", "2", "--block-size", "4", "--device", "cpu", "--no-hf", "--pass-major",
         "--num-kv-blocks", "40", "--host-kv-cache-gb", "0.01"]


def test_the_host_tier_run_beside_recompute_all_at_once(tiny_models, tmp_path):
    output = tmp_path / "tiers.json"
    assert main(["bench", "prefix", "--model", str(tiny_models["llama"]), *TIERS,
                 "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    recompute, host = record["results"]["recompute"], record["results"]["host"]
    # 40 blocks of 4 hold 4 of the 8 requests: when a group's second request comes its prefix
    # has left the device; recompute computes it again, the host tier gives it back. All at
    # once, each run is the same every time (one preemption in each: 7 blocks are device hits
    # in both, and the host tier also gives the preempted sequence its blocks back)
    assert recompute["prompt_tokens_computed"] == 16 * 40 - 7 * 4
    assert host["tiers"]["host_cache_hits"] == 67 * 4
    assert host["prompt_tokens_computed"] == 16 * 40 - 7 * 4 - 67 * 4
    assert record["table"].startswith("| W4 tiers, all at once |")
    assert "ttft_each_s" not in host and host["ttft_repeats_s"]["p50"] > 0
    assert "| TTFT p50 first pass ms | TTFT p50 repeats ms |" in record["table"]


def test_pass_by_pass_the_first_pass_and_the_repeats_have_their_own_ttft():
    from cluster.bench.prefix_tiers import pass_ttfts

    args = argparse.Namespace(pass_major=True, num_groups=4)
    # the groups' first requests (new prefixes) took 10-40 ms, their repeats 1-4 ms
    figures = pass_ttfts([0.04, 0.01, 0.03, 0.02, 0.002, 0.004, 0.001, 0.003], args)
    assert (figures["ttft_first_pass_s"]["p50"], figures["ttft_repeats_s"]["p50"]) == (0.02, 0.002)
    assert (figures["ttft_first_pass_s"]["p99"], figures["ttft_repeats_s"]["p99"]) == (0.04, 0.004)
    assert pass_ttfts([0.04, 0.01], argparse.Namespace(pass_major=False, num_groups=1)) == {}


def test_the_tier_runs_take_poisson_arrivals(tiny_models, tmp_path):
    output = tmp_path / "tiers-poisson.json"
    assert main(["bench", "prefix", "--model", str(tiny_models["llama"]), *TIERS,
                 "--request-rate", "400", "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    for run in record["results"].values():  # what arrives when is the clock's: counts only
        assert run["num_requests"] == 16 and run["output_tokens"] == 16 * 2
        assert run["prompt_tokens"] == 16 * 40
        assert run["prompt_tokens_cached"] + run["prompt_tokens_computed"] == 16 * 40
    assert record["table"].startswith("| W4 tiers, 400 req/s |")


def test_a_negative_request_rate_is_refused(tiny_models, capsys):
    assert main(["bench", "prefix", "--model", str(tiny_models["llama"]), *TIERS,
                 "--request-rate", "-1"]) == 2
    assert capsys.readouterr().err == "tandem: error: --request-rate must be at least 0, got -1.0\n"


def test_loads_in_place_are_a_run_more_beside_the_plain_host_tier():
    from cluster.bench.prefix_tiers import tier_runs

    args = argparse.Namespace(host_kv_cache_gb=8.0, host_loads_in_place=True,
                              disk_kv_cache_dir=None, disk_kv_cache_gb=10.0)
    assert tier_runs(args) == {"recompute": {}, "host": {"host_kv_cache_gb": 8.0},
                               "host, in place": {"host_kv_cache_gb": 8.0,
                                                  "host_loads_in_place": True}}
    args.host_loads_in_place = False
    assert list(tier_runs(args)) == ["recompute", "host"]
