"""One request that raises inside the engine fails alone: the step, the other requests and
the KV cache are unharmed. In-process, on a tiny model with a scripted tokenizer."""

import logging

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import OutputAccumulator, RequestFailed
from router.sampling_params import SamplingParams

POISON = 1000  # a token of the tiny llama's vocabulary (1001) that greedy never picks here
GOOD_PROMPT = [5, 6, 7, 8, 9]
BAD_PROMPT = [11, 12, POISON]


class ScriptedTokenizer:
    """Decodes ids as their numbers; raises on any text holding POISON (the bad prompt's),
    as a tokenizer with a bug would, deep inside detokenizing."""

    all_special_ids: list[int] = []
    eos_token_id = None

    def __init__(self, fail_setup: bool = False) -> None:
        self.fail_setup = fail_setup

    def decode(self, ids, **_):
        if POISON in ids:
            raise RuntimeError("decoder state corrupt at /srv/tokenizers/decode.rs:88")
        return "".join(f"<{i}>" for i in ids)


def engine(tiny_models, tokenizer=None) -> LLMEngine:
    e = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", dtype="float32",
                               num_kv_blocks=64, block_size=4))
    e.tokenizer = tokenizer or ScriptedTokenizer()
    return e


def run(e: LLMEngine) -> tuple[dict[str, OutputAccumulator], dict[str, RequestFailed]]:
    """Streams every request to its end: accumulated outputs, and the errors that ended some."""
    outputs: dict[str, OutputAccumulator] = {}
    failures: dict[str, RequestFailed] = {}
    while e.has_unfinished():
        for delta in e.step_deltas():
            try:
                outputs.setdefault(delta.request_id, OutputAccumulator()).add(delta)
            except RequestFailed as error:
                failures[delta.request_id] = error
    return outputs, failures


def test_a_request_that_fails_while_detokenizing_fails_alone(tiny_models, caplog):
    solo = engine(tiny_models)
    solo.add_request(GOOD_PROMPT, SamplingParams(max_tokens=12, temperature=0.0), "good")
    expected = run(solo)[0]["good"].output
    assert POISON not in expected.token_ids  # else the good request would be poisoned too

    e = engine(tiny_models)
    e.add_request(GOOD_PROMPT, SamplingParams(max_tokens=12, temperature=0.0), "good")
    e.add_request(BAD_PROMPT, SamplingParams(max_tokens=12, temperature=0.0, n=2), "bad")
    with caplog.at_level(logging.ERROR, logger="cluster.engine.llm_engine"):
        outputs, failures = run(e)
    assert list(failures) == ["bad"]
    assert str(failures["bad"]) == ("the engine failed request bad while turning its tokens "
                                    "into text (RuntimeError); other requests were not affected")
    good = outputs["good"].output
    assert (good.token_ids, good.text, good.finish_reason) == (
        expected.token_ids, expected.text, "length")
    # the exception, with its traceback, is in the log, once (not once per completion)
    [record] = [r for r in caplog.records if "request bad failed" in r.getMessage()]
    assert "decode.rs:88" in str(record.exc_info[1])
    assert not e.requests and not e.seq_to_request
    assert e.metrics.finished_requests == {"length": 1, "abort": 1}
    assert e.scheduler.kv.num_used_blocks == 0
    e.scheduler.kv.check_integrity()
    # the engine goes on serving
    e.add_request(GOOD_PROMPT, SamplingParams(max_tokens=12, temperature=0.0), "again")
    assert run(e)[0]["again"].output.token_ids == expected.token_ids


def test_offline_outputs_carry_the_error(tiny_models):
    e = engine(tiny_models)
    e.add_request(BAD_PROMPT, SamplingParams(max_tokens=4, temperature=0.0), "bad")
    finished = []
    while e.has_unfinished():
        finished += e.step(only_finished=True)
    [output] = finished
    assert output.finished and output.finish_reason == "abort"
    assert output.error == ("the engine failed request bad while turning its tokens into text "
                            "(RuntimeError); other requests were not affected")


def test_a_detokenizer_that_cannot_be_set_up_refuses_only_its_request(tiny_models):
    class NoSetup(ScriptedTokenizer):
        @property
        def all_special_ids(self):  # type: ignore[override]
            raise KeyError("special_tokens_map.json")

    e = engine(tiny_models, NoSetup())
    with pytest.raises(RequestFailed) as error:
        e.add_request(GOOD_PROMPT, SamplingParams(max_tokens=4), "x")
    assert str(error.value) == ("the engine failed request x while setting up its detokenizer "
                                "(KeyError); other requests were not affected")
    assert not e.requests and not e.has_unfinished()


def test_seeds_of_n_samples_wrap_at_64_bits(tiny_models):
    """The n samples of a request use seed, seed + 1, ...: past 2**64 - 1 that wraps to 0, as
    manual_seed reads a seed (two's complement), instead of overflowing in the sampler."""
    e = engine(tiny_models)
    sampled = dict(max_tokens=6, temperature=1.0)
    e.add_request(GOOD_PROMPT, SamplingParams(n=2, seed=2**64 - 1, **sampled), "wrap")
    e.add_request(GOOD_PROMPT, SamplingParams(seed=0, **sampled), "zero")
    e.add_request(GOOD_PROMPT, SamplingParams(seed=-1, **sampled), "minus-one")
    outputs, failures = run(e)
    assert not failures
    wrapped = outputs["wrap"].output.outputs
    assert wrapped[1].token_ids == outputs["zero"].output.token_ids
    assert wrapped[0].token_ids == outputs["minus-one"].output.token_ids  # -1 is 2**64 - 1
