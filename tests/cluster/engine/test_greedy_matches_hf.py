"""Greedy output equals transformers' generate(), token for token, under every batch shape."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from workers.worker import Lookahead

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


@pytest.mark.parametrize("name", MODELS)
def test_whole_prompts_only_and_a_scheduler_delay(tiny_models, expected, name):
    # without chunked prefill a prompt waits for a step with room for all of it; the delay
    # factor holds new prompts back while others run (both change only when prompts run)
    llm, tokens = generate(tiny_models[name], num_kv_blocks=256, enable_chunked_prefill=False,
                           max_num_batched_tokens=64, scheduler_delay_factor=0.5)
    assert tokens == expected[name]
    assert llm.engine.max_model_len == 64  # a sequence fits one step (a recompute, too)


def test_a_budget_that_follows_the_measured_step_cost(tiny_models, expected):
    # a target no CPU step makes: the budget falls to its floor (64 / 8 tokens, or every
    # decode), prompts go in chunks of that size as the fit sets it
    llm, tokens = generate(tiny_models["llama"], num_kv_blocks=256, max_num_batched_tokens=64,
                           tpot_target_ms=0.001)
    assert tokens == expected["llama"]
    assert llm.engine.scheduler.token_budget.costs.fit() is not None


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


def generate_counting(folder, **engine_args):
    """(tokens, rows sampled by the worker, calls that looked ahead, the LLM)."""
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
              **engine_args)
    worker = llm.engine.executor.worker
    rows, lookaheads = [], []
    compute_logits, execute = worker.model.compute_logits, worker.execute

    def counting_logits(hidden):
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    def counting_execute(step):
        lookaheads.append(step.lookahead)
        return execute(step)

    worker.model.compute_logits, worker.execute = counting_logits, counting_execute
    tokens = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    return tokens, sum(rows), sum(lookaheads), llm


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_lookahead_steps_start_the_next_call(tiny_models, expected, name):
    """Multi-step calls that also run the next call's first step: the same tokens, and each
    such step is taken up by the next call, not run again (as many rows sampled as without)."""
    tokens, rows, lookaheads, llm = generate_counting(tiny_models[name], decode_steps=5,
                                                      decode_lookahead=True)
    plain_tokens, plain_rows, plain_lookaheads, _ = generate_counting(
        tiny_models[name], decode_steps=5, decode_lookahead=False)
    assert tokens == plain_tokens == expected[name]
    # 5-step calls at 3, 8 and 13 tokens look ahead; the one at 18 ends the requests
    assert (lookaheads, plain_lookaheads) == (3, 0)
    assert rows == plain_rows
    assert llm.engine.executor.worker.lookahead is None  # the last call looked ahead of nobody
    assert llm.stats().kv_blocks_used == 0
    llm.engine.scheduler.kv.check_integrity()

def test_a_lookahead_is_dropped_when_the_batch_changes(tiny_models, expected):
    """A request arriving after a call that looked ahead: the next call is not its
    continuation (a prefill joins), so the lookahead's row is thrown away and computed again;
    when a request ends, the other goes on from the lookahead without it. Tokens stay those
    of transformers for both requests."""
    from cluster.engine.config import EngineConfig
    from cluster.engine.llm_engine import LLMEngine

    def run(lookahead: bool):
        engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), device="cpu",
                                        dtype="float32", block_size=4, num_kv_blocks=256,
                                        decode_steps=5, decode_lookahead=lookahead))
        worker, rows = engine.executor.worker, []
        compute_logits = worker.model.compute_logits
        worker.model.compute_logits = lambda h: rows.append(h.shape[0]) or compute_logits(h)
        tokens: dict[str, list[int]] = {}

        def step():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids

        first = engine.add_request(PROMPTS[1], GREEDY)
        for _ in range(3):  # the prefill, then two 5-step calls
            step()
        pending = worker.lookahead is not None
        second = engine.add_request(PROMPTS[3], GREEDY)
        while engine.has_unfinished():
            step()
        return [tokens[first], tokens[second]], sum(rows), pending

    tokens, rows, pending = run(True)
    plain_tokens, plain_rows, _ = run(False)
    assert pending  # the second call had looked ahead when the request came
    assert tokens == plain_tokens == [expected["llama"][1], expected["llama"][3]]
    # the dropped lookahead's row, and one row of the call in which the first request ends: it
    # looks ahead for both (the second goes on), and the next call takes up the second's row
    assert rows == plain_rows + 2


def test_calls_go_on_from_the_lookahead_without_the_requests_that_ended(tiny_models,
                                                                        monkeypatch):
    """Requests of different lengths end in different calls; each call after such an end takes
    up the lookahead's rows of the requests that go on (their logprobs too), and tokens and
    logprobs stay those of calls without the lookahead."""
    picked = []
    taken_up = Lookahead.taken_up

    def recording(lookahead, picks):
        picked.append((len(lookahead.request_ids), picks.tolist()))
        return taken_up(lookahead, picks)

    monkeypatch.setattr(Lookahead, "taken_up", recording)
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2) for n in (7, 20, 12)]

    def run(lookahead: bool):
        llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", block_size=4,
                  num_kv_blocks=256, decode_steps=4, decode_lookahead=lookahead)
        outputs = [out.outputs[0] for out in llm.generate(PROMPTS[:3], params)]
        assert llm.stats().kv_blocks_used == 0
        llm.engine.scheduler.kv.check_integrity()
        return outputs

    looked_ahead, plain = run(True), run(False)
    # after the prefill's token, calls of 4 steps: the first request (7 tokens) ends in the
    # second call, the third (12) in the third; the calls after those take up only the rows
    # of the requests that go on; the second request's last call (3 tokens) looks ahead of none
    assert picked == [(3, [0, 1, 2]), (3, [1, 2]), (2, [0]), (1, [0])]
    for got, want in zip(looked_ahead, plain, strict=True):
        assert got.token_ids == want.token_ids
        assert [[t for t, _ in row] for row in got.logprobs] == [
            [t for t, _ in row] for row in want.logprobs]
        assert all(abs(u - v) < 1e-5 for a, b in zip(got.logprobs, want.logprobs, strict=True)
                   for (_, u), (_, v) in zip(a, b, strict=True))


def test_a_call_queues_its_tokens_for_the_host_before_its_lookahead(tiny_models, expected):
    """The host then waits for this call's tokens alone, not for the lookahead behind them:
    that step runs on the device while the host reads and schedules."""
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=256, decode_steps=5, decode_lookahead=True,
              async_scheduling=False)  # the prefill's call reads it (not the next call)
    worker, events = llm.engine.executor.worker, []
    start_read, forward_decode, execute = (worker._start_read, worker._forward_decode,
                                           worker.execute)

    def logged(name, fn):
        return lambda *args: events.append(name) or fn(*args)

    worker._start_read = logged("read", start_read)
    worker._forward_decode = logged("step", forward_decode)
    worker.execute = logged("|", execute)
    tokens = llm.generate([PROMPTS[1]], GREEDY)[0].token_ids
    assert tokens == expected["llama"][1]
    # the prefill (run outside _forward_decode), then 5-step calls: the first runs 5 steps and
    # the lookahead after its read; the next two take that step up and run 4 + 1 more; the
    # last (4 tokens to go) looks ahead of nothing
    calls = " ".join(events).split("| ")[1:]
    assert calls == ["read ", "step step step step step read step ",
                     "step step step step read step ", "step step step step read step ",
                     "step step step read"]


def test_aborting_a_request_with_a_lookahead_pending(tiny_models, expected, monkeypatch):
    """A request aborted after a call that looked ahead for it: its blocks (the lookahead's
    slot too) go back at once, the next call (the other request alone) takes up the
    lookahead's row of the request that stays, which keeps transformers' tokens."""
    from cluster.engine.config import EngineConfig
    from cluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), device="cpu",
                                    dtype="float32", block_size=4, num_kv_blocks=256,
                                    decode_steps=5, decode_lookahead=True,
                                    async_scheduling=False))  # the prefill read by its call
    worker, tokens, taken = engine.executor.worker, {}, []
    taken_up = Lookahead.taken_up

    def recording(lookahead, picks):
        taken.append((list(lookahead.request_ids), picks.tolist()))
        return taken_up(lookahead, picks)

    monkeypatch.setattr(Lookahead, "taken_up", recording)

    def step():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids

    kept = engine.add_request(PROMPTS[1], GREEDY)
    aborted = engine.add_request(PROMPTS[3], GREEDY)
    for _ in range(2):  # the prefill, then a 5-step call that looks ahead for both
        step()
    assert worker.lookahead is not None and set(worker.lookahead.request_ids) == {kept, aborted}
    engine.abort(aborted)
    step()
    assert taken == [([kept, aborted], [0])]  # the kept request's row of the lookahead
    while engine.has_unfinished():
        step()
    assert tokens[kept] == expected["llama"][1]
    assert len(tokens[aborted]) == 6  # the prefill's token and the first call's five
    assert worker.lookahead is None and aborted not in worker.states
    assert engine.stats().kv_blocks_used == 0
    engine.scheduler.kv.check_integrity()
