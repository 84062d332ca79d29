"""Decode CUDA graphs under tensor parallelism: TP=2 replay equals TP=2 eager (two GPUs).

Run on a machine with two GPUs: ``python -m pytest -m gpu tests/workers/test_tp_graphs.py``.
"""

import pytest


@pytest.mark.gpu
def test_tensor_parallel_graph_replay_matches_eager(ray_session, tiny_models):
    """Two GPUs: TP=2 replaying decode graphs (NCCL all-reduce inside) equals TP=2 eager.
    If the graphs are off, the shard actors' logs say why ("decode CUDA graphs off")."""
    import ray

    from cluster.llm import LLM
    from router.sampling_params import SamplingParams

    prompts = [[1, 2, 3, 4, 5], [7] * 20, [9, 8, 7], list(range(40, 77))]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    # eager one step a call; graphs 8 steps a call (rank 0 broadcasts each step's tokens)
    for eager, steps in [(True, 1), (False, 8)]:
        llm = LLM(model=str(tiny_models["llama"]), device="cuda", dtype="float32",
                  num_kv_blocks=128, enforce_eager=eager, max_num_seqs=8,
                  tensor_parallel_size=2, distributed_executor_backend="ray",
                  decode_steps=steps)
        try:
            actors = llm.engine.executor.actors
            assert ray.get([a.uses_cuda_graphs.remote() for a in actors]) == [not eager] * 2
            outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
            outs[eager, "again"] = [o.token_ids for o in llm.generate(prompts[:3], params)]
        finally:
            llm.engine.shutdown()
    assert outs[True] == outs[False]
    assert outs[True, "again"] == outs[False, "again"]
