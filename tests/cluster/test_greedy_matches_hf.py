"""Greedy output equals transformers' generate(), token for token, under every batch shape."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams

SHARED = list(range(40, 72))  # a 32-token prefix that several prompts share
PROMPTS = [
    SHARED + [5, 6, 7],
    [3, 1, 4, 1, 5, 9, 2, 6],
    SHARED + [900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910],
    [11],
    SHARED[:20] + [77, 78],
]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
MODELS = ["llama-tied", "llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def expected(tiny_models):
    """transformers' greedy continuations, one prompt at a time (no padding)."""
    result = {}
    for name in MODELS:
        hf = AutoModelForCausalLM.from_pretrained(tiny_models[name], dtype=torch.float32)
        result[name] = [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in PROMPTS
        ]
    return result


def generate(folder, **engine_args):
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, **engine_args)
    outputs = llm.generate(PROMPTS, GREEDY)
    llm.engine.scheduler.kv.check_integrity()
    return llm, [out.token_ids for out in outputs]


@pytest.mark.parametrize("name", MODELS)
def test_default_settings(tiny_models, expected, name):
    llm, tokens = generate(tiny_models[name], num_kv_blocks=256)
    assert tokens == expected[name]
    assert llm.stats().kv_blocks_used == 0


@pytest.mark.parametrize("name", MODELS)
def test_prefix_cache_hits_give_the_same_tokens(tiny_models, expected, name):
    llm, first = generate(tiny_models[name], num_kv_blocks=256)
    hits_before = llm.stats().prefix_cache_hits
    second = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert first == second == expected[name]
    # every prompt's full blocks but the one holding its last token are found again
    expected_hits = sum((len(p) - 1) // 4 * 4 for p in PROMPTS)
    assert llm.stats().prefix_cache_hits - hits_before == expected_hits
    llm.engine.scheduler.kv.check_integrity()


@pytest.mark.parametrize("name", MODELS)
def test_preemption_under_a_tiny_kv_cache(tiny_models, expected, name):
    # 24 blocks of 4 tokens cannot hold all five sequences at once (they need ~40)
    llm, tokens = generate(tiny_models[name], num_kv_blocks=24)
    assert tokens == expected[name]
    assert llm.stats().num_preemptions > 0


@pytest.mark.parametrize("name", MODELS)
def test_prefill_in_chunks_of_three_tokens(tiny_models, expected, name):
    llm, tokens = generate(tiny_models[name], num_kv_blocks=256, max_prefill_chunk=3,
                           max_num_batched_tokens=7)
    assert tokens == expected[name]


def test_small_budget_and_one_sequence_at_a_time(tiny_models, expected):
    _, tokens = generate(tiny_models["qwen3"], num_kv_blocks=256, max_num_seqs=1,
                         max_num_batched_tokens=5, enable_prefix_caching=False)
    assert tokens == expected["qwen3"]


@pytest.mark.parametrize("name", MODELS)
def test_several_decode_steps_per_call(tiny_models, expected, name):
    # 5 steps a call: calls end mid-block, straddle blocks, and are cut short by max_tokens
    llm, tokens = generate(tiny_models[name], num_kv_blocks=256, decode_steps=5)
    assert tokens == expected[name]
    assert llm.stats().kv_blocks_used == 0
