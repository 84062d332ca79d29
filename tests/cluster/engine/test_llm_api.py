"""The offline API: sampling, seeds, n, logprobs, stops, and clear errors for bad input."""

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(20, 45))]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), device="cpu", block_size=4, num_kv_blocks=128,
               max_model_len=64)


def tokens(outputs):
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=s) for s in (1, 1, 2)]
    first = tokens(llm.generate(PROMPTS[:1] * 3, params))
    again = tokens(llm.generate(PROMPTS[:1] * 3, params))
    assert first == again
    assert first[0] == first[1] != first[2]


def test_seeded_sampling_survives_preemption(tiny_models, llm):
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=16, seed=7)
    roomy = tokens(llm.generate(PROMPTS, params))
    tight = LLM(str(tiny_models["llama"]), device="cpu", block_size=4, num_kv_blocks=14)
    assert tokens(tight.generate(PROMPTS, params)) == roomy
    assert tight.stats().num_preemptions > 0


def test_n_completions_are_distinct_seeded_samples(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=3))
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) == 3
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out[0].outputs)


def test_logprobs_match_the_model_distribution(tiny_models, llm):
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    logits = hf(torch.tensor([PROMPTS[1] + out.token_ids])).logits[0]
    for step, entry in enumerate(out.outputs[0].logprobs):
        expected = torch.log_softmax(logits[len(PROMPTS[1]) - 1 + step], dim=-1)
        top = expected.topk(2)
        assert entry[0][0] == out.token_ids[step] == top.indices[0].item()
        assert [token for token, _ in entry[1:]] == top.indices.tolist()
        assert entry[0][1] == pytest.approx(top.values[0].item(), abs=1e-4)


def test_stop_token_ids_and_max_model_len(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10))[0]
    stop_at = greedy.token_ids[3]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10,
                                                  stop_token_ids=[stop_at]))[0]
    first = greedy.token_ids.index(stop_at)
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop_at)
    long = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=500))[0]
    assert (len(PROMPTS[2]) + len(long.token_ids), long.finish_reason) == (64, "length")


def test_metrics_report_ttft_and_cached_tokens(llm):
    llm.generate(PROMPTS[2], SamplingParams(max_tokens=1))
    started = time.monotonic()  # the engine's clock
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=2))[0]
    took = time.monotonic() - started
    assert out.metrics.num_cached_tokens == 24  # 25 prompt tokens: 6 full blocks of 4
    assert 0 < out.metrics.ttft <= took  # in seconds, within the call, however slow it was


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    (list(range(64)), SamplingParams(),
     "prompt has 64 tokens: max_model_len is 64, which leaves no room to generate"),
    ([1, 2, 5000], SamplingParams(), "token id 5000 is out of range for a vocabulary of 1001"),
    ("hello", SamplingParams(), "this model has no tokenizer: give prompts as token ids"),
])
def test_bad_prompts_are_refused_and_change_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError) as error:
        llm.generate([[1, 2, 3], prompt], params)
    assert str(error.value) == message
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert llm.stats().kv_blocks_used == 0


def test_prompt_longer_than_the_kv_cache(tiny_models):
    small = LLM(str(tiny_models["llama"]), device="cpu", block_size=4, num_kv_blocks=8)
    with pytest.raises(ValueError) as error:
        small.generate(list(range(40)))
    assert str(error.value) == (
        "prompt has 40 tokens: the KV cache holds 32 tokens, which leaves no room to generate")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.01}, "top_p must be in (0, 1], got 1.01"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == message


def test_unknown_model_name():
    with pytest.raises(ValueError, match="^unknown model 'no-such-model': not a folder and not in "
                                         "the catalog"):
        LLM("no-such-model", device="cpu")


def test_unsupported_architecture(tmp_path, tiny_models):
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((tiny_models["llama"] /
                                                  "model.safetensors").read_bytes())
    with pytest.raises(ValueError) as error:
        LLM(str(tmp_path), device="cpu", num_kv_blocks=8)
    assert str(error.value) == (
        "unsupported architecture 'GPT2LMHeadModel' (supported: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)")


def test_folder_without_weights(tmp_path, tiny_models):
    (tmp_path / "config.json").write_text((tiny_models["llama"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError) as error:
        LLM(str(tmp_path), device="cpu", num_kv_blocks=8)
    assert str(error.value) == f"no *.safetensors weights in {tmp_path}"


def test_bad_engine_config():
    with pytest.raises(ValueError) as error:
        LLM("x", block_size=0)
    assert str(error.value) == "block_size must be at least 1, got 0"
