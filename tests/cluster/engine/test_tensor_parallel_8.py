"""TP=8 on the CPU: eight gloo ranks give transformers' greedy tokens, with prefix hits and
preemption (eight query heads, two kv heads each replicated on four ranks; a vocabulary of 517
whose padding to 1024 leaves ranks 5-7 no real row of the embedding or LM head). TP=4 runs through
Ray actors in tests/cluster/ray/test_tensor_parallel_4.py; eight actors start too slowly on
this machine, so TP=8 runs the same worker and collectives in forked ranks
(gloo_executor.py)."""

import json
from dataclasses import replace
from pathlib import Path

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine_setup import worker_config
from cluster.engine.llm_engine import LLMEngine
from tests.cluster.engine.gloo_executor import GlooExecutor, follow, spawn_ranks
from tests.workers.gloo_group import gloo_group
from workers.worker import Worker

SHARED = list(range(40, 60))  # a 20-token prefix two prompts share
# 515 and 516 are the last real rows of the vocabulary (517), next to the padding; at TP 8 they
# are rank 4's, and ranks 5-7 hold padding alone
PROMPTS = [SHARED + [5, 6, 7], [3, 1, 4, 1, 5], SHARED + [515, 516]]
MAX_TOKENS = 8
# 12 blocks of 4 tokens cannot hold the three sequences at once: one is preempted
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=12,
              tensor_parallel_size=8, distributed_executor_backend="ray")


def hf_greedy(folder, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in prompts]


def run_rank(rank: int, folder: str, store_file: str, result_file: str) -> None:
    from router.sampling_params import SamplingParams

    torch.set_num_threads(1)
    config = EngineConfig(model=folder, **ENGINE)
    with gloo_group(rank, 8, store_file) as tp:
        worker = Worker(worker_config(config, Path(folder)), tp)
        if rank > 0:
            follow(worker)
            return
        executor = GlooExecutor(worker)
        engine = LLMEngine(config, executor=executor)
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        deferred = []
        execute = executor.execute
        executor.execute = lambda step: deferred.append(step.defer_read) or execute(step)
        runs = []
        # the second finds every prompt's full blocks cached; the third schedules each step
        # while the ranks run the one before (its tokens broadcast on the device)
        for async_scheduling in (False, False, True):
            engine.config = replace(engine.config, async_scheduling=async_scheduling)
            deferred.clear()
            ids = [engine.add_request(p, greedy) for p in PROMPTS]
            outputs = {}
            while engine.has_unfinished():
                outputs |= {o.request_id: o.token_ids for o in engine.step(only_finished=True)
                            if o.finished}
            stats = engine.stats()
            runs.append({"tokens": [outputs[i] for i in ids], "hits": stats.prefix_cache_hits,
                         "preemptions": stats.num_preemptions, "deferred": sum(deferred)})
        engine.scheduler.kv.check_integrity()
        engine.shutdown()
        with open(result_file, "w") as f:
            json.dump(runs, f)


def test_tensor_parallel_8_over_gloo_matches_transformers(tiny_models, tmp_path):
    folder = str(tiny_models["llama-8-heads"])
    spawn_ranks(run_rank, (folder, str(tmp_path / "store"), str(tmp_path / "runs.json")), 8)
    first, second, third = json.loads((tmp_path / "runs.json").read_text())
    expected = hf_greedy(folder, PROMPTS)
    assert first["tokens"] == second["tokens"] == third["tokens"] == expected
    assert first["deferred"] == second["deferred"] == 0 and third["deferred"] >= MAX_TOKENS
    assert first["preemptions"] > 0 and first["hits"] > 0
    assert second["hits"] > first["hits"]
