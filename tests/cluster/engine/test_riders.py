"""Rows whose sampling must see each token before the next on the host (penalties, min_tokens)
ride along in calls of several decode steps, keeping their first token alone; a grammar's
rows keep every step's token (the worker reads each during the call and masks the next).
Either way every row's tokens are those of one step a call."""

import re

from cluster import LLM, SamplingParams
from tests.cluster.engine.test_speculative import PROMPTS

PLAIN = SamplingParams(temperature=0.0, max_tokens=20)
PENALIZED = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3,
                           presence_penalty=0.4)


def run(folder, prompts, params, decode_steps: int, warm=()):  # type: ignore[no-untyped-def]
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
              decode_steps=decode_steps, decode_lookahead=True)
    for warm_params in warm:  # a grammar compiled before joins its batch's first step
        llm.generate(prompts[:1], warm_params)
    execute, calls = llm.engine.executor.execute, []

    def counting(step):  # type: ignore[no-untyped-def]
        calls.append((step.num_steps, step.lookahead, len(step.scheduled)))
        return execute(step)

    llm.engine.executor.execute = counting
    outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    llm.engine.scheduler.kv.check_integrity()
    assert llm.engine.scheduler.kv.num_used_blocks == 0
    return outputs, calls


def test_penalized_rows_ride_along_in_multi_step_calls(tiny_models):
    params = [PENALIZED, PLAIN, PENALIZED, PLAIN]
    one_step, _ = run(tiny_models["llama"], PROMPTS, params, decode_steps=1)
    several, calls = run(tiny_models["llama"], PROMPTS, params, decode_steps=4)
    assert several == one_step
    assert one_step[0] != run(tiny_models["llama"], PROMPTS[:1], PLAIN, 1)[0][0]  # penalized
    # calls of 4 steps while the penalized rows ran beside the plain ones, none looking
    # ahead; the penalized rows alone, after, one step a call
    assert (4, False, 4) in calls
    assert all(not lookahead for steps, lookahead, rows in calls if rows == 4)
    assert calls[-1] == (1, False, 2)


def test_penalized_rows_alone_run_one_step_a_call(tiny_models):
    _, calls = run(tiny_models["llama"], PROMPTS[:2], [PENALIZED] * 2, decode_steps=4)
    assert {steps for steps, _, _ in calls} == {1}


def test_grammar_rows_keep_every_step_of_a_multi_step_call(tiny_chat_model):
    """A grammar row decoding when a plain one joins: the calls after run 4 steps for both,
    then for the grammar row alone, none with a lookahead step; its output follows the
    grammar, a seeded sampled choice is the one of one step a call, and every row's tokens
    are those of one step a call."""
    from cluster.engine.config import EngineConfig
    from cluster.engine.llm_engine import LLMEngine

    pattern = r"\d{3}-\d{4}-\d{4}-\d{4}"
    structured = SamplingParams(temperature=0.0, max_tokens=40,
                                structured_outputs={"regex": pattern})
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs={
        "choice": ["alpha beta gamma delta", "one two three four five six"]})
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run_engine(decode_steps: int):  # type: ignore[no-untyped-def]
        engine = LLMEngine(EngineConfig(model=str(tiny_chat_model), device="cpu",
                                        dtype="float32", num_kv_blocks=256,
                                        decode_steps=decode_steps, decode_lookahead=True))
        execute, calls, texts = engine.executor.execute, [], {}
        engine.executor.execute = lambda step: calls.append(
            (step.num_steps, step.lookahead, len(step.scheduled))) or execute(step)

        def step() -> None:
            for out in engine.step():
                texts[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].text)

        first = engine.add_request("Phone number:", structured)
        third = engine.add_request("Pick one:", sampled)
        while not all(w.grammar.done() for w in engine.grammars.waiting):
            engine.grammars.wait(5.0)  # both join in one step, whatever the pool's timing
        while not any(seq.num_output_tokens for seq in engine.scheduler.running):
            step()  # its grammar compiled, its prompt computed: it decodes
        second = engine.add_request("Tell me a story:", plain)
        while engine.has_unfinished():
            step()
        engine.scheduler.kv.check_integrity()
        return texts[first], texts[second], texts[third], calls

    (tokens, text), other, choice, _ = run_engine(decode_steps=1)
    (tokens4, text4), other4, choice4, calls = run_engine(decode_steps=4)
    assert (tokens4, other4, choice4) == (tokens, other, choice)
    assert re.fullmatch(pattern, text)
    assert choice[1] in sampled.structured_outputs.choice
    # the grammar rows' prompts, the plain one's; then calls of four steps for every row,
    # until the plain row and the choice end, and for the last grammar row alone; no
    # lookahead step after a grammar's row
    assert calls == [(1, False, 2), (1, False, 3), (4, False, 3), (4, False, 3), (4, False, 3),
                     (4, False, 2), (4, False, 1)]


def test_a_grammar_row_with_penalties_rides_along_and_keeps_its_grammar(tiny_chat_model):
    """A row with both: its penalties make it ride along (its first token of each call kept),
    and its matcher sees exactly the tokens kept, so later calls mask from the right state."""
    pattern = r"[a-c]{6}-[0-9]{6}"
    both = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3,
                          structured_outputs={"regex": pattern})
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Code:", "Tell me a story:"]
    one_step, _ = run(tiny_chat_model, prompts, [both, plain], 1, warm=[both])
    several, calls = run(tiny_chat_model, prompts, [both, plain], 4, warm=[both])
    assert several == one_step
    assert (4, False, 2) in calls  # the plain row's four steps, the other's first kept
    llm = LLM(str(tiny_chat_model), device="cpu", dtype="float32", num_kv_blocks=64)
    assert re.fullmatch(pattern, llm.generate(["Code:"], both)[0].outputs[0].text)
