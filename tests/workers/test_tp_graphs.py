"""Decode CUDA graphs under tensor parallelism: TP=2 replay equals TP=2 eager (two GPUs).

Run on a machine with two GPUs: ``python -m pytest -m gpu tests/workers/test_tp_graphs.py``
(with fewer, both tests are skipped: "needs 2 GPUs, this machine has 1"; tests/gpus.py).
"""

import pytest


@pytest.mark.gpu(gpus=2)
def test_tensor_parallel_graph_replay_matches_eager(ray_session, tiny_models):
    """Two GPUs: TP=2 replaying decode graphs equals TP=2 eager, with the small sums inside the
    graphs done by NCCL or by the peer-memory kernel. If the graphs or the peer-memory sums are
    off, the shard actors' logs say why."""
    import ray

    from cluster.engine.llm import LLM
    from router.sampling_params import SamplingParams

    prompts = [[1, 2, 3, 4, 5], [7] * 20, [9, 8, 7], list(range(40, 77))]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    # eager one step a call; graphs 8 steps a call (rank 0 broadcasts each step's tokens)
    # the last with the lookahead step (tokens kept on every rank for the next call)
    for eager, steps, symmetric in [(True, 1, False), (False, 8, False), (False, 8, True)]:
        llm = LLM(model=str(tiny_models["llama"]), device="cuda", dtype="float32",
                  num_kv_blocks=128, enforce_eager=eager, max_num_seqs=8,
                  tensor_parallel_size=2, distributed_executor_backend="ray",
                  decode_steps=steps, symmetric_all_reduce=symmetric,
                  decode_lookahead=symmetric)
        try:
            actors = llm.engine.executor.actors
            assert ray.get([a.uses_cuda_graphs.remote() for a in actors]) == [not eager] * 2
            assert ray.get([a.uses_symmetric_all_reduce.remote() for a in actors]) == \
                [symmetric] * 2
            key = (eager, symmetric)
            outs[key] = [o.token_ids for o in llm.generate(prompts, params)]
            outs[key, "again"] = [o.token_ids for o in llm.generate(prompts[:3], params)]
        finally:
            llm.engine.shutdown()
    baseline = outs[True, False]
    assert outs[False, False] == baseline and outs[False, True] == baseline
    again = outs[(True, False), "again"]
    assert outs[(False, False), "again"] == again and outs[(False, True), "again"] == again


@pytest.mark.gpu(gpus=2)
def test_peer_memory_sums_equal_nccl_at_decode_sizes():
    """Two GPUs, one process each: the peer-memory sums of bf16 rows (PyTorch's one-shot
    kernel and the push kernel, first and again after hundreds of sums in graphs) equal NCCL's
    bit for bit at every decode size measured, and no push sum gave up on its peer."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "sums.json"
        subprocess.run([sys.executable, "-m", "tools.profile.all_reduce", "--rows", "1", "3",
                        "64", "--hidden", "1024", "--replays", "2",
                        "--output", str(out)], check=True, timeout=240)
        rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["one_shot_equal"], r["push_equal"], r["push_peer_missed"])
            for r in rows] == [(1, True, True, False), (3, True, True, False),
                               (64, True, True, False)]
