"""A request cut off mid-stream continues on a fresh engine from its prompt plus the tokens it
had sent, and the whole stream is the one a clean run gives: tokens, text (a real tokenizer:
multi-byte characters, held-back stop strings) and finish reasons. In-process, no Ray."""

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import OutputAccumulator
from cluster.engine.resume import Resume, ResumedCompletion
from router.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the default model's tokenizer

PROMPT = [504, 360, 314, 649, 314, 887, 28, 260]  # in both tiny vocabularies


def engine(folder) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                  num_kv_blocks=64, block_size=4))


def stream(e: LLMEngine, accumulator: OutputAccumulator, stop_after: int | None = None):
    """Feeds the engine's deltas of its one request into ``accumulator``; with
    ``stop_after``, returns (unfinished) once every completion has at least that many tokens,
    as a replica that dies there would leave it."""
    while e.has_unfinished():
        for delta in e.step_deltas():
            output = accumulator.add(delta)
            if stop_after is not None and not output.finished and all(
                    len(c.token_ids) >= stop_after for c in output.outputs):
                return output
    return accumulator.output


def run_clean(folder, params: SamplingParams):
    e = engine(folder)
    e.add_request(PROMPT, params, "r")
    return stream(e, OutputAccumulator())


@pytest.mark.parametrize(("model", "params"), [
    ("chat", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
    # seeded sampling with a penalty: the noise and the penalised history must both continue
    # (on the small vocabulary: sampling over 49k tokens is slow on the CPU, and ids suffice)
    ("llama", SamplingParams(temperature=1.0, top_p=0.9, seed=7, repetition_penalty=1.3,
                             max_tokens=40, ignore_eos=True, logprobs=2)),
    # two seeded samples, and min_tokens that the cut falls inside
    ("llama", SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=30, min_tokens=20,
                             ignore_eos=True)),
], ids=["greedy-text", "seeded-penalty-logprobs", "seeded-n2-min-tokens"])
def test_a_resumed_request_gives_exactly_the_clean_run(tiny_chat_model, tiny_models, model,
                                                       params):
    folder = tiny_chat_model if model == "chat" else tiny_models[model]
    clean = run_clean(folder, params)
    first, accumulator = engine(folder), OutputAccumulator()
    first.add_request(PROMPT, params, "r")
    cut = stream(first, accumulator, stop_after=9)
    assert 9 <= len(cut.token_ids) < params.max_tokens
    first.shutdown()
    second = engine(folder)
    second.add_request(PROMPT, params, "r", resume=Resume.from_output(cut, elapsed_s=0.5))
    resumed = stream(second, accumulator)
    for got, want in zip(resumed.outputs, clean.outputs, strict=True):
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids, want.text, want.finish_reason)
        if want.logprobs is not None:  # the continuation's entries follow the ones sent (a
            # prefill and a decode sum in another order: the values agree to float32 rounding)
            for got_entry, want_entry in zip(got.logprobs[len(cut.token_ids):],
                                             want.logprobs[len(cut.token_ids):], strict=True):
                assert [t for t, _ in got_entry] == [t for t, _ in want_entry]
                assert [v for _, v in got_entry] == pytest.approx([v for _, v in want_entry],
                                                                  abs=1e-4)
    assert len(clean.text) > 20 or model != "chat"  # text, not only ids
    assert second.scheduler.kv.num_used_blocks == 0
    second.scheduler.kv.check_integrity()
    # no second first token: the continuation's time-to-first-token is not counted again
    assert second.metrics.time_to_first_token.count == 0
    assert second.metrics.finished_requests == {"length": 1}


def test_a_stop_string_held_back_at_the_cut_still_ends_the_text_there(tiny_chat_model):
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    text = run_clean(tiny_chat_model, free).text
    stop = text[len(text) * 2 // 3:][:4]  # found late in the text, after the cut
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    clean = run_clean(tiny_chat_model, params)
    assert clean.finish_reason == "stop" and clean.text == text[: text.index(stop)]
    first, accumulator = engine(tiny_chat_model), OutputAccumulator()
    first.add_request(PROMPT, params, "r")
    cut = stream(first, accumulator, stop_after=6)
    second = engine(tiny_chat_model)
    second.add_request(PROMPT, params, "r", resume=Resume.from_output(cut, elapsed_s=0.0))
    resumed = stream(second, accumulator)
    assert (resumed.text, resumed.finish_reason, resumed.outputs[0].stop_reason) == (
        clean.text, "stop", stop)


def test_a_finished_sample_of_n_is_not_run_again(tiny_chat_model):
    params = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)
    clean = run_clean(tiny_chat_model, params)
    resume = Resume((ResumedCompletion(tuple(clean.outputs[0].token_ids), "length"),
                     ResumedCompletion(tuple(clean.outputs[1].token_ids[:5]))), 0.1)
    e = engine(tiny_chat_model)
    e.add_request(PROMPT, params, "r", resume=resume)
    assert [s.request_id for s in e.scheduler.waiting] == ["r#1"]
    deltas = []
    while e.has_unfinished():
        deltas += e.step_deltas()
    new = {c.index: [] for c in deltas[0].completions}
    for delta in deltas:
        for c in delta.completions:
            new[c.index] += c.new_token_ids
    assert new == {0: [], 1: clean.outputs[1].token_ids[5:]}


def test_a_resume_that_does_not_fit_the_request_is_refused(tiny_chat_model):
    e = engine(tiny_chat_model)
    params = SamplingParams(max_tokens=4, n=2)
    with pytest.raises(ValueError, match="a resumed request carries 1 completions for n = 2"):
        e.add_request(PROMPT, params, "r", resume=Resume((ResumedCompletion((1,)),)))
    full = Resume((ResumedCompletion((1, 2, 3, 4)), ResumedCompletion(())))
    with pytest.raises(ValueError, match="completion 0 of a resumed request has 4 tokens and "
                                         "no finish reason, with max_tokens = 4"):
        e.add_request(PROMPT, params, "r", resume=full)
    assert not e.requests and not e.has_unfinished()
