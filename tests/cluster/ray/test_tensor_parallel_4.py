"""TP=4 through Ray actors over gloo, its STRICT_PACK group, and the refusals that come at
once: a model TP does not split, a group no node can hold (TP=8 is tested over gloo ranks in
tests/cluster/engine/test_tensor_parallel_8.py)."""

import pytest
import ray

from cluster import LLM, EngineConfig, SamplingParams
from cluster.ray.placement import PlacementInfeasible
from cluster.ray.tandem_cluster import TandemCluster
from tests.cluster.engine.test_tensor_parallel_8 import MAX_TOKENS, PROMPTS, hf_greedy

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_tensor_parallel_4_over_ray_matches_transformers_in_one_strict_pack_group(
        ray_session, tiny_models):
    """Eight query heads over two kv heads, each replicated on two ranks; a vocabulary of 517,
    padded to 768, leaves rank 3 padding alone (rows 576-767; it loads no row); 12 blocks of 4
    tokens preempt one of the three sequences, and the second round hits the prefix cache."""
    folder = tiny_models["llama-8-heads"]
    llm = LLM(str(folder), device="cpu", block_size=4, num_kv_blocks=12,
              tensor_parallel_size=4, distributed_executor_backend="ray")
    try:
        expected = hf_greedy(folder, PROMPTS)
        assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == expected
        first = llm.stats()
        assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == expected
        assert first.num_preemptions > 0 and first.prefix_cache_hits > 0
        assert llm.stats().prefix_cache_hits > first.prefix_cache_hits
        llm.engine.scheduler.kv.check_integrity()
        group = ray.util.placement_group_table(llm.engine.executor.placement_group)
        assert group["strategy"] == "STRICT_PACK"
        # a quarter of a CPU a shard: TP=8 fits a 2-core machine
        assert group["bundles"] == {rank: {"CPU": 0.25} for rank in range(4)}
        assert len(set(group["bundles_to_node_id"].values())) == 1
        assert len(set(llm.engine.executor.shard_pids())) == 4
    finally:
        llm.engine.shutdown()


def test_a_model_tensor_parallel_does_not_split_is_refused_before_any_shard_starts(
        ray_session, tiny_models):
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=8 does not split this model: "
                       r"4 attention heads over 2 kv heads, intermediate size 128 \(sizes that "
                       r"do: 1, 2, 4\)$"):
        LLM(str(tiny_models["llama"]), device="cpu", tensor_parallel_size=8,
            distributed_executor_backend="ray")


def test_a_replica_no_node_can_hold_is_refused_at_once(ray_session, tiny_models):
    """The session's Ray has 8 CPUs and no GPU, and no autoscaler: four GPU shards, or five
    TP=8 CPU replicas (2 CPUs each), can never be placed, so they fail now, not after 600 s."""
    folder = str(tiny_models["llama-8-heads"])
    groups = ray.util.placement_group_table()
    with pytest.raises(PlacementInfeasible, match=r"^TP=4 needs 4 GPUs and 4 CPUs on one "
                       r"node; the largest node has 0 GPUs; no autoscaler node types are "
                       r"configured to add a node$"):
        LLM(folder, device="cuda", tensor_parallel_size=4, distributed_executor_backend="ray")
    with pytest.raises(PlacementInfeasible, match=r"^5 replicas: each of them TP=8 needs 2 "
                       r"CPUs on one node; the nodes hold 4 such groups; no autoscaler"):
        TandemCluster(EngineConfig(model=folder, device="cpu", tensor_parallel_size=8),
                      num_replicas=5)
    assert ray.util.placement_group_table().keys() == groups.keys()  # none was asked for
