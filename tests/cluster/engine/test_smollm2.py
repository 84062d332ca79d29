"""The embedded default model, SmolLM2-135M-Instruct: token for token with transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from workers.catalog import DEFAULT_MODEL, model_path

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a GPU is.",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16, num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf():
    """transformers' model, loaded once for the tests that compare against it."""
    return AutoModelForCausalLM.from_pretrained(model_path(DEFAULT_MODEL), dtype=torch.float32)


@pytest.fixture(scope="module")
def greedy_answers(llm):
    """The engine's greedy answers to QUESTIONS, asked together (each of the real model's 48
    decode steps costs ~0.1 s here): computed once, for the tests that compare with them."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)


@pytest.fixture(scope="module")
def first_answer_alone(llm):
    """The engine's greedy answer to the first question, asked alone."""
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    return llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]


def test_chat_matches_transformers_token_for_token(llm, hf, greedy_answers):
    outputs = greedy_answers
    for question, out in zip(QUESTIONS, outputs, strict=True):
        prompt = llm.engine.chat_prompt([{"role": "user", "content": question}])
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                               do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == expected, question
    assert "Paris" in outputs[0].text
    assert outputs[0].finish_reason == "stop" and outputs[0].token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in outputs[0].text


def test_stop_string_is_cut_from_the_text(llm, first_answer_alone):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    full = first_answer_alone
    assert "France is Paris" in full.text
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                            stop=["is Paris"]))[0]
    assert out.text == full.text[: full.text.index("is Paris")]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", "is Paris")


def test_several_decode_steps_per_call_keep_text_stops_and_logprobs(llm):
    """Multi-step calls that also look ahead one step give one-step-a-call's text, stops,
    seeded samples and logprobs."""
    multi = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16, num_kv_blocks=256,
                decode_steps=6, decode_lookahead=True)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    results = []
    for params in [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["is Paris"]),
                   SamplingParams(temperature=0.8, seed=11, max_tokens=20, logprobs=2, n=2)]:
        one_at_a_time, several = llm.chat(conversations, params), multi.chat(conversations, params)
        results.append(several)
        for a, b in zip(one_at_a_time, several, strict=True):
            for x, y in zip(a.outputs, b.outputs, strict=True):
                assert (y.text, y.token_ids, y.finish_reason, y.stop_reason) == (
                    x.text, x.token_ids, x.finish_reason, x.stop_reason)
                if x.logprobs is not None:
                    assert [[t for t, _ in row] for row in y.logprobs] == [
                        [t for t, _ in row] for row in x.logprobs]
                    pairs = zip(x.logprobs, y.logprobs, strict=True)
                    assert all(abs(u - v) < 1e-4 for rx, ry in pairs
                               for (_, u), (_, v) in zip(rx, ry, strict=True))
    stopped, sampled = results
    assert (stopped[0].finish_reason, stopped[0].outputs[0].stop_reason) == ("stop", "is Paris")
    assert sampled[0].outputs[0].token_ids != sampled[0].outputs[1].token_ids  # n=2 distinct
    assert multi.stats().kv_blocks_used == 0
    multi.engine.scheduler.kv.check_integrity()


def test_shared_system_prompt_hits_the_prefix_cache(llm):
    system = {"role": "system", "content": "You are a terse assistant. " * 8}
    conversations = [[system, {"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.chat(conversations[:1], params)
    before = llm.stats().prefix_cache_hits
    outputs = llm.chat(conversations[1:], params)
    assert llm.stats().prefix_cache_hits > before
    assert all(out.metrics.num_cached_tokens >= 64 for out in outputs)


def test_min_tokens_holds_eos_back_as_transformers_does(llm, hf, first_answer_alone):
    """The greedy answer ends with EOS after some tokens; asked for more than that, the EOS is
    masked until then (token for token transformers' min_new_tokens), in one-step and
    multi-step calls alike, and a stop string before min_tokens does not end it."""
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    natural = first_answer_alone
    assert natural.finish_reason == "stop" and len(natural.token_ids) < MAX_TOKENS - 12
    at_least = len(natural.token_ids) + 6
    params = SamplingParams(temperature=0.0, max_tokens=at_least + 6, min_tokens=at_least)
    prompt = llm.engine.chat_prompt(messages)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=at_least + 6,
                           min_new_tokens=at_least, do_sample=False)[0, len(prompt):].tolist()
    multi = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16, num_kv_blocks=256,
                decode_steps=4)
    for engine in (llm, multi):
        out = engine.chat(messages, params)[0]
        assert out.token_ids == expected
        assert len(out.token_ids) >= at_least and 2 not in out.token_ids[:at_least]
        assert out.token_ids[: len(natural.token_ids) - 1] == natural.token_ids[:-1]
    stopped = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                stop=["Paris"], min_tokens=at_least))[0]
    assert "Paris" in stopped.text[: len(natural.text)]  # not cut where it first appears
    assert len(stopped.token_ids) >= at_least


def test_the_shipped_eagle3_head_drafts_the_same_tokens_and_is_accepted(greedy_answers):
    """`{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3"}` works out of the box:
    the packaged head (hash-checked) keeps the plain engine's greedy tokens, and its drafts
    are accepted (a random head of this shape makes ~1.0 tokens a verify)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    plain = greedy_answers  # the plain engine's answers to the same conversations and params
    eagle = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16, num_kv_blocks=256,
                speculative_config={"method": "eagle3", "model": "smollm2-135m-instruct-eagle3",
                                    "num_speculative_tokens": 3, "adaptive": False})
    drafted = eagle.chat(conversations, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    stats = eagle.stats()
    verifies = stats.spec_decode_num_drafts
    per_position = eagle.engine.metrics.spec_decode_accepted_per_position[:3]
    assert verifies > 0 and per_position[0] >= per_position[1] >= per_position[2]
    assert (stats.spec_decode_num_accepted_tokens + verifies) / verifies > 1.4
