"""Structured outputs on the default model, end to end through ``LLM``: outputs that parse and
validate, plain rows untouched beside constrained ones, the same greedy output through
preemption and speculation, and bad constraints refused before anything is queued."""

import json
import math
import re
from collections import Counter

import jsonschema
import pytest

from cluster import LLM, SamplingParams
from workers.catalog import DEFAULT_MODEL, model_path

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3}},
    "required": ["name", "age", "languages"]}
PROMPT = "Describe a person as JSON with name, age and languages:"


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16, num_kv_blocks=256)


def structured(**kind) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=kind)


def test_json_schema_output_validates_and_ends_with_stop(llm):
    out = llm.generate([PROMPT], structured(json=PERSON))[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)
    assert list(json.loads(out.text)) == ["name", "age", "languages"]  # the schema's order


def test_plain_rows_beside_constrained_ones_keep_their_tokens(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate(["The capital of France is"], plain)[0].outputs[0].token_ids
    outs = llm.generate([PROMPT, "The capital of France is", "Pick a color:"],
                        [structured(json=PERSON), plain, structured(choice=["red", "blue"])])
    assert outs[1].outputs[0].token_ids == alone
    assert outs[2].outputs[0].text in ("red", "blue")


def test_regex_choice_and_sampled_rows_match(llm):
    outs = llm.generate(["Phone number:"] * 4, [
        structured(regex=r"\d{3}-\d{4}"),
        *[SamplingParams(temperature=1.0, seed=s, max_tokens=8, structured_outputs={
            "choice": ["yes", "no", "maybe"]}) for s in (1, 2, 3)]])
    assert re.fullmatch(r"\d{3}-\d{4}", outs[0].outputs[0].text)
    assert all(o.outputs[0].text in ("yes", "no", "maybe") for o in outs[1:])


def test_the_same_greedy_object_through_preemption():
    small = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16, num_kv_blocks=7,
                enable_prefix_caching=False)
    params = structured(json=PERSON)
    alone = small.generate([PROMPT], params)[0].outputs[0].token_ids
    outs = small.generate([PROMPT] * 4, params)  # 4 x 3 blocks in 7: someone is recomputed
    assert small.engine.scheduler.num_preemptions > 0
    assert all(o.outputs[0].token_ids == alone for o in outs)


def test_async_scheduling_runs_constrained_and_penalized_rows_ahead_with_the_same_output(llm):
    """Each step is launched before the one before is read; a row's matcher (and a penalty's
    history) gets its last token while the step's forward runs: the outputs are the
    synchronous engine's, preemption included."""
    prompts = [PROMPT, "Pick a color:", "The capital of France is", "Count: one, two,"]
    params = [structured(json=PERSON),
              SamplingParams(temperature=1.0, seed=5, max_tokens=8,
                             structured_outputs={"choice": ["red", "green", "blue"]}),
              SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=9, max_tokens=24, frequency_penalty=0.5)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for blocks in (256, 6):  # 6: someone is preempted with a token in flight
        ahead = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16,
                    num_kv_blocks=blocks, async_scheduling=True, enable_prefix_caching=False)
        ahead.generate(prompts[:2], params[:2])  # compiled before: both join in one step
        deferred = []
        execute = ahead.engine.executor.execute

        def spy(step, execute=execute, deferred=deferred):  # type: ignore[no-untyped-def]
            deferred.append(step.defer_read)
            return execute(step)

        ahead.engine.executor.execute = spy  # type: ignore[method-assign]
        outs = ahead.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
        assert sum(deferred) > len(deferred) // 2  # most steps ran ahead
        assert (ahead.engine.scheduler.num_preemptions > 0) == (blocks == 6)


SPECULATED = [PROMPT, 'Repeat: {"name": "Ann", "age": 3, "languages": ["en"]}']


@pytest.fixture(scope="module")
def greedy_structured(llm):
    """The plain engine's greedy objects for SPECULATED: computed once, for each proposer."""
    return [o.outputs[0].token_ids for o in llm.generate(SPECULATED, structured(json=PERSON))]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculation_keeps_the_greedy_structured_output(greedy_structured, proposer):
    # the draft model (the target itself, fixed length) proposes without the grammar: drafts
    # are cut at the first token it rejects
    config = ({"method": "ngram", "num_speculative_tokens": 4} if proposer == "ngram" else
              {"model": str(model_path(DEFAULT_MODEL)), "num_speculative_tokens": 3,
               "adaptive": False})
    spec = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", block_size=16, num_kv_blocks=256,
               speculative_config=config)
    outs = spec.generate(SPECULATED, structured(json=PERSON))
    assert [o.outputs[0].token_ids for o in outs] == greedy_structured
    stats = spec.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_logit_bias_forces_and_bans_tokens(llm):
    ids = llm.engine.tokenize(" Paris")
    banned = llm.generate(["The capital of France is"], SamplingParams(
        temperature=0.0, max_tokens=4, logit_bias={ids[0]: -100}))[0].outputs[0]
    assert ids[0] not in banned.token_ids
    forced = llm.generate(["Hello"], SamplingParams(
        temperature=0.0, max_tokens=3, logit_bias={ids[0]: 100}))[0].outputs[0]
    assert forced.token_ids == [ids[0]] * 3


@pytest.mark.parametrize(("kind", "message"), [
    ({"regex": "a(?=b)"}, "structured_outputs.regex does not compile: Regex parsing error at "
                          "position 4: Lookahead is not supported yet."),
    ({"json": {"$ref": "#/nope"}}, "structured_outputs.json does not compile: Cannot find "
                                   "field 'nope' in #/nope"),
    ({"grammar": 'root ::= "a" | b'}, "structured_outputs.grammar does not compile: EBNF "
                                      "parser error at line 1, column 16: Rule \"b\" is not "
                                      "defined"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_nothing_is_queued(llm, kind,
                                                                             message):
    with pytest.raises(ValueError) as error:
        llm.engine.add_request(PROMPT, structured(**kind))
    assert str(error.value) == message
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_out_of_vocabulary_bias_and_eos_rules_are_refused(llm):
    with pytest.raises(ValueError, match="logit_bias token id 49152 is out of range"):
        llm.engine.add_request(PROMPT, SamplingParams(logit_bias={49152: 1.0}))
    with pytest.raises(ValueError, match="ignore_eos cannot be used with structured outputs"):
        SamplingParams(ignore_eos=True, structured_outputs={"json_object": True})
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})


# chi-square's 0.1% critical values by degrees of freedom: a sound sampler fails 1 in 1,000
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def test_a_sampled_choice_is_distributed_as_the_masked_target(llm):
    """The first token of a 3-way choice, 400 seeds: its counts against the masked
    distribution (the logprobs the engine reports, which are the constrained ones)."""
    prompt, choices = "Is it raining? Answer yes, no or maybe:", ["yes", "no", "maybe"]
    probe = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=1, logprobs=20,
                                                  structured_outputs={"choice": choices}))
    target = {t: math.exp(lp) for t, lp in probe[0].outputs[0].logprobs[0][1:]
              if lp > -math.inf}
    assert abs(sum(target.values()) - 1) < 1e-3  # every allowed token is in the top 20
    n = 400
    outs = llm.generate([prompt] * n, [SamplingParams(
        temperature=1.0, max_tokens=1, seed=seed, structured_outputs={"choice": choices})
        for seed in range(n)])
    counts = Counter(o.outputs[0].token_ids[0] for o in outs)
    assert set(counts) <= set(target)
    big = [t for t, p in target.items() if n * p >= 5]
    cells = [(counts[t], n * target[t]) for t in big]
    rest = n - sum(c for c, _ in cells)
    cells.append((rest, n * (1 - sum(target[t] for t in big))))
    cells = [(c, e) for c, e in cells if e > 0]
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    assert chi2 < CRITICAL[len(cells) - 1], (chi2, cells)


WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_required_tool_calls_parse_and_validate(llm, choice):
    from cluster.engine.tokenizer import apply_chat_template
    from router.tool_calls import Tool, parse_tool_calls, tool_call_constraint

    tools = [Tool("get_weather", "The current weather in a city.", WEATHER_SCHEMA),
             Tool("get_time", "The time in a city.",
                  {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 20}}})]
    ids = apply_chat_template(llm.engine.tokenizer, [
        {"role": "user", "content": "What is the weather in Paris, in celsius?"}], tools)
    params = SamplingParams(temperature=0.0, max_tokens=120,
                            structured_outputs=tool_call_constraint(tools, choice, False))
    out = llm.generate([ids], params)[0].outputs[0]
    parsed = parse_tool_calls(out.text)
    assert out.finish_reason == "stop" and parsed.content == ""
    (call,) = parsed.calls
    assert call.complete and call.name in ("get_weather", "get_time")
    schema = tools[0].parameters if call.name == "get_weather" else tools[1].parameters
    jsonschema.validate(json.loads(call.arguments), schema)
    assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
