"""Async scheduling: each step is scheduled while the workers run the one before, whose tokens
come back with the next call. Whatever the batch does (preemption with a token in flight,
chunks, prefix hits, seeds, logprobs, stops, aborts), the output is the synchronous engine's."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from workers.deferred_tokens import check_deferrable, read_own_tokens
from workers.request_state import RequestState
from workers.sampler import SamplingSpec
from workers.step_input import ScheduledRequest, StepInput, StepOutput

SHARED = list(range(40, 72))
PROMPTS = [SHARED + [5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6], [11], SHARED[:20] + [77, 78],
           SHARED + [900, 901, 902]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


@pytest.fixture(scope="module")
def expected(tiny_models):
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    return [hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in PROMPTS]


class Calls:
    """Each executor call: (it ran rows, its read was deferred, it returned the tokens of the
    step before)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.calls: list[tuple[bool, bool, bool]] = []
        self.steps: list[StepInput] = []
        execute = engine.executor.execute

        def spy(step):  # type: ignore[no-untyped-def]
            self.steps.append(step)
            output = execute(step)
            self.calls.append((bool(step.scheduled), step.defer_read,
                               output.previous is not None))
            return output

        engine.executor.execute = spy  # type: ignore[method-assign]

    @property
    def deferred(self) -> int:
        return sum(deferred for _, deferred, _ in self.calls)


def engine(folder, **args) -> tuple[LLM, Calls]:
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, **args)
    return llm, Calls(llm.engine)


@pytest.mark.parametrize("args", [
    {"num_kv_blocks": 256},
    {"num_kv_blocks": 24},  # preempted, some with a token in flight
    {"num_kv_blocks": 256, "max_prefill_chunk": 3, "max_num_batched_tokens": 7},
], ids=["default", "preemption", "chunks"])
def test_greedy_output_is_transformers_with_every_step_deferred(tiny_models, expected, args):
    llm, calls = engine(tiny_models["llama"], async_scheduling=True, **args)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [out.token_ids for out in outputs] == expected
    # every call that ran rows deferred its read, and each call after a deferred one
    # returned its tokens (a call without rows only reads them)
    assert all(deferred for rows, deferred, _ in calls.calls if rows)
    assert [previous for _, _, previous in calls.calls] == [False] + [
        deferred for _, deferred, _ in calls.calls[:-1]]
    assert calls.deferred >= len(calls.calls) - 3
    assert llm.stats().kv_blocks_used == 0
    llm.engine.scheduler.kv.check_integrity()
    if args["num_kv_blocks"] == 24:
        assert llm.stats().num_preemptions > 0
        # and again, from the prefix cache
        again = llm.generate(PROMPTS, GREEDY)
        assert [out.token_ids for out in again] == expected


def test_seeds_logprobs_stops_and_n_are_the_synchronous_engines(tiny_models):
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=16),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[17, 40, 101, 250]),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, stop_token_ids=[17]),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    prompts = PROMPTS[: len(params)]
    sync_llm, _ = engine(tiny_models["qwen3"], num_kv_blocks=64)
    async_llm, calls = engine(tiny_models["qwen3"], num_kv_blocks=64, async_scheduling=True)
    want = sync_llm.generate(prompts, params)
    got = async_llm.generate(prompts, params)
    for mine, theirs in zip(got, want, strict=True):
        assert [(c.token_ids, c.finish_reason, c.stop_reason) for c in mine.outputs] == [
            (c.token_ids, c.finish_reason, c.stop_reason) for c in theirs.outputs]
        # the same tokens ranked; values to float32's rounding (a step's batch differs when a
        # row of a finished sequence rides along in the step after its end)
        assert [logprob_ids(c.logprobs) for c in mine.outputs] == [
            logprob_ids(c.logprobs) for c in theirs.outputs]
        assert [v for c in mine.outputs for v in logprob_values(c.logprobs)] == pytest.approx(
            [v for c in theirs.outputs for v in logprob_values(c.logprobs)], abs=1e-5)
    assert calls.deferred > 10
    assert async_llm.stats().kv_blocks_used == 0


def logprob_ids(logprobs):  # type: ignore[no-untyped-def]
    return None if logprobs is None else [[t for t, _ in step] for step in logprobs]


def logprob_values(logprobs):  # type: ignore[no-untyped-def]
    return [] if logprobs is None else [v for step in logprobs for _, v in step]


def test_a_penalized_row_runs_ahead_its_history_read_while_the_step_runs(tiny_models,
                                                                         expected):
    penalized = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3)
    sync_llm, _ = engine(tiny_models["llama"], num_kv_blocks=128)
    want = [out.token_ids for out in sync_llm.generate(PROMPTS[:2], [GREEDY, penalized])]
    llm, calls = engine(tiny_models["llama"], num_kv_blocks=128, async_scheduling=True)
    got = [out.token_ids for out in llm.generate(PROMPTS[:2], [GREEDY, penalized])]
    assert got == want and got[0] == expected[0]
    assert calls.deferred > 10


def test_aborting_a_request_whose_token_is_in_flight(tiny_models, expected):
    llm, calls = engine(tiny_models["llama"], num_kv_blocks=128, async_scheduling=True)
    core = llm.engine
    ids = [core.add_request(prompt, GREEDY) for prompt in PROMPTS[:3]]
    streamed: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while core.has_unfinished():
        for delta in core.step_deltas():
            streamed[delta.request_id] += delta.completions[0].new_token_ids
        if len(streamed[ids[1]]) == 5 and core.in_flight is not None and ids[1] in core.requests:
            core.abort(ids[1])  # its sixth token is on the device
    assert streamed[ids[0]] == expected[0] and streamed[ids[2]] == expected[2]
    assert streamed[ids[1]] == expected[1][:5]
    assert core.stats().kv_blocks_used == 0 and not core.requests and calls.deferred > 0
    core.scheduler.kv.check_integrity()


def test_a_worker_refuses_a_deferred_step_it_cannot_run_ahead():
    several = StepInput([], [ScheduledRequest("a", 2, 1)], [], num_steps=4, defer_read=True)
    with pytest.raises(ValueError, match="runs one decode step, not several"):
        check_deferrable(several)
    drafts = StepInput([], [ScheduledRequest("a", 2, 3, draft_token_ids=[4, 5])], [],
                       defer_read=True)
    with pytest.raises(ValueError, match="request 'a' verifies drafts in a step whose read "
                                         "is deferred"):
        check_deferrable(drafts)
    check_deferrable(StepInput([], [ScheduledRequest("a", 2, 1)], [], defer_read=True))


def test_rows_that_sample_from_their_tokens_get_the_step_befores_over_the_placeholder():
    penalized = SamplingSpec(temperature=0.0, repetition_penalty=1.2)
    a = RequestState([1, 2, 3], 2, [0], penalized, None, "a")
    plain = RequestState([1, 2], 2, [0], SamplingSpec(), None, "b")
    for state in (a, plain):
        state.add_placeholder()
    read_own_tokens([a, plain], StepOutput(["b", "a"], [[8], [7]]))
    assert a.token_ids == [1, 2, 3, 7] and a.num_placeholders == 1  # the next message's too
    assert plain.token_ids == [1, 2, 0]  # its sampling reads no token: left for the message
    a.apply(ScheduledRequest("a", 4, 1, new_token_ids=[7]))
    assert a.token_ids == [1, 2, 3, 7] and a.num_placeholders == 0
    a.add_placeholder()
    with pytest.raises(ValueError, match=r"request 'a' has 1 unread token\(s\) that the step "
                                         "before did not sample"):
        read_own_tokens([a], StepOutput(["b"], [[8]]))


def test_placeholders_are_written_over_by_the_tokens_the_host_read():
    state = RequestState([1, 2, 3], 2, [0], SamplingSpec(), None, "a")
    state.add_placeholder()
    state.add_placeholder()
    assert state.token_ids == [1, 2, 3, 0, 0] and state.num_placeholders == 2
    state.apply(ScheduledRequest("a", 4, 1, new_token_ids=[9]))
    assert state.token_ids == [1, 2, 3, 9, 0] and state.num_placeholders == 1
    state.apply(ScheduledRequest("a", 5, 1, new_token_ids=[8, 7]))
    assert state.token_ids == [1, 2, 3, 9, 8, 7] and state.num_placeholders == 0


def test_speculation_that_is_off_runs_ahead_until_its_next_try(tiny_models):
    """An unrelated draft (adaptive) is turned off within its first verify steps; from then
    on steps are deferred (the next choice drafts nothing) until a try, which reads first."""
    long = SamplingParams(temperature=0.0, max_tokens=60)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    want = [hf.generate(torch.tensor([p]), max_new_tokens=60, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in PROMPTS[:3]]
    for draft, accepts in (("llama-draft", False), ("llama", True)):
        config = {"model": str(tiny_models[draft]), "num_speculative_tokens": 3,
                  "adaptive": True}
        llm, calls = engine(tiny_models["llama"], num_kv_blocks=256, async_scheduling=True,
                            speculative_config=config)
        assert [out.token_ids for out in llm.generate(PROMPTS[:3], long)] == want
        verifies = [s for s in calls.steps if any(i.num_model_drafts for i in s.scheduled)]
        assert verifies and not any(s.defer_read for s in verifies)  # a verify reads first
        stats = llm.stats()
        if accepts:  # the target as its draft keeps drafting
            assert stats.spec_decode_num_accepted_tokens >= 0.95 * (
                stats.spec_decode_num_draft_tokens)
        else:  # off: most steps ran ahead
            assert stats.spec_decode_num_accepted_tokens < 0.2 * (
                stats.spec_decode_num_draft_tokens)
            assert calls.deferred > len(calls.steps) // 2
        assert llm.stats().kv_blocks_used == 0
