"""A quantized KV cache gives one greedy answer whatever the cache held before: the default
model's tokens alone and cold are the tokens batched, chunked, preempted and as prefix hits
(workers/layers/batch_invariant.py says why they were not: a key's last bit, computed in a
call of another shape, crossed a rounding boundary of the one-byte format)."""

import pytest

from cluster import LLM, SamplingParams
from workers.catalog import DEFAULT_MODEL

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Explain photosynthesis in one sentence.",  # fp8 gave 28 tokens cold, 27 as a prefix hit
    "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def engine(kv_cache_dtype: str, **options) -> LLM:
    return LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16,
               kv_cache_dtype=kv_cache_dtype, **{"num_kv_blocks": 64} | options)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_greedy_tokens_do_not_depend_on_what_the_cache_holds(kv_cache_dtype):
    cold = engine(kv_cache_dtype, enable_prefix_caching=False)
    prompts = [cold.engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    want = [cold.generate([prompt], GREEDY)[0].outputs[0].token_ids for prompt in prompts]
    # both at once in chunks of 7 prompt tokens, in 5 blocks (the two need 6):
    # batched, chunked and preempted
    busy = engine(kv_cache_dtype, max_prefill_chunk=7, num_kv_blocks=5)
    assert [out.outputs[0].token_ids for out in busy.generate(prompts, GREEDY)] == want
    assert busy.stats().num_preemptions > 0
    # again: the prompts' full blocks are prefix hits now
    hits = busy.stats().prefix_cache_hits
    assert [out.outputs[0].token_ids for out in busy.generate(prompts, GREEDY)] == want
    assert busy.stats().prefix_cache_hits > hits
