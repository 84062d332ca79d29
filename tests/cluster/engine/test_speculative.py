"""Speculative decoding: greedy output equals transformers', token for token, whatever the
drafts (prompt lookup's, or an oracle's that knows the answer, corrupted at will); sampled
output keeps its seed; the counters add up."""


import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from cluster.bench.speculative import Oracle
from cluster.engine.metrics import EngineMetrics
from cluster.engine.speculation import Speculator
from kvstore.block_hash import hash_block_tokens
from router.scheduler import ScheduledSequence, SchedulerOutput
from router.sequence import Sequence
from tests.router.test_speculation import fitted
from workers.speculative.config import SpeculativeConfig

LOOP = [7, 8, 9, 10, 11, 12]
PROMPTS = [
    LOOP * 5,  # copy-heavy: lookup finds long matches
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4],
    list(range(40, 72)) + list(range(40, 50)),  # a suffix that occurred earlier
    [11],
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def expected(tiny_models):
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in PROMPTS]


def ngram(k: int, adaptive: bool = False, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": adaptive, **extra}


def run(folder, prompts=PROMPTS, params=GREEDY, **engine_args):
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, **engine_args)
    outputs = llm.generate(prompts, params)
    kv = llm.engine.scheduler.kv
    kv.check_integrity()
    assert kv.num_used_blocks == 0
    return llm, [out.token_ids for out in outputs]


def oracle(continuations, wrong=0.0, seed=0, prompts=PROMPTS):
    """The benchmark's proposer: the expected continuation, each token replaced by a wrong
    one with probability ``wrong`` (seeded), so acceptance is known."""
    answers = {tuple(p): c for p, c in zip(prompts, continuations, strict=True)}
    return Oracle(answers, alpha=1.0 - wrong, vocab=1001, seed=seed)


def run_with(folder, proposer, prompts=PROMPTS, params=GREEDY, **engine_args):
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, **engine_args)
    llm.engine.speculator.proposer = proposer
    outputs = llm.generate(prompts, params)
    llm.engine.scheduler.kv.check_integrity()
    return llm, [out.token_ids for out in outputs]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_equals_transformers_for_every_k(tiny_models, expected, k):
    llm, tokens = run(tiny_models["llama"], num_kv_blocks=256, speculative_config=ngram(k))
    assert tokens == expected
    stats = llm.stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens <= k * stats.spec_decode_num_drafts
    # drafts that are all right are all kept: k + 1 tokens a verify step
    llm, tokens = run_with(tiny_models["llama"], oracle(expected), num_kv_blocks=256,
                           speculative_config=ngram(k))
    assert tokens == expected
    stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    # after the prefill's token, each verify step makes k + 1 (the last one fewer; a last
    # token alone is a plain step, with no room for a draft)
    assert stats.spec_decode_num_drafts == len(PROMPTS) * -(-(MAX_TOKENS - 2) // (k + 1))
    # and drafts that are all wrong are all rejected, the output the same
    llm, tokens = run_with(tiny_models["llama"], oracle(expected, wrong=1.0),
                           num_kv_blocks=256, speculative_config=ngram(k))
    assert tokens == expected
    assert llm.stats().spec_decode_num_accepted_tokens == 0


def test_acceptance_follows_the_share_of_right_drafts(tiny_models, expected):
    llm, tokens = run_with(tiny_models["llama"], oracle(expected, wrong=0.3, seed=1),
                           num_kv_blocks=256, speculative_config=ngram(3))
    assert tokens == expected
    stats = llm.stats()
    rate = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    assert 0.25 < rate < 0.75  # a draft is kept when it and those before it are right
    per_position = llm.engine.metrics.spec_decode_accepted_per_position
    assert per_position[0] >= per_position[1] >= per_position[2] > 0


def test_greedy_equals_transformers_under_chunks_preemption_and_prefix_hits(tiny_models,
                                                                           expected):
    # 24 blocks of 4 tokens for four sequences of up to 54: someone is always preempted
    llm, tokens = run_with(tiny_models["llama"], oracle(expected, wrong=0.2),
                           num_kv_blocks=24, max_num_batched_tokens=16,
                           speculative_config=ngram(4))
    assert tokens == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.stats().spec_decode_num_accepted_tokens > 0
    again = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert again == expected
    assert llm.stats().prefix_cache_hits > 0
    llm.engine.scheduler.kv.check_integrity()


def tokens_of(tiny_models):
    return run(tiny_models["llama"], num_kv_blocks=256)[1]


def test_no_draft_token_is_ever_cached(tiny_models):
    """Every cached block's hash is the hash of verified tokens: those of some sequence's
    final output (a rejected draft in a cached block would make a hash nobody produced)."""
    llm, tokens = run_with(tiny_models["llama"], oracle(tokens_of(tiny_models), 0.5),
                           num_kv_blocks=256, speculative_config=ngram(5))
    assert llm.stats().spec_decode_num_accepted_tokens > 0
    kv = llm.engine.scheduler.kv
    produced = set()
    for prompt, output in zip(PROMPTS, tokens, strict=True):
        full, parent = prompt + output, None
        for start in range(0, len(full) - 3, 4):
            parent = hash_block_tokens(parent, full[start : start + 4], kv.extra_keys)
            produced.add(parent)
    cached = set(kv.cached_hashes())
    assert cached and cached <= produced


def test_seeded_sampling_repeats_and_counts_add_up(tiny_models):
    params = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=MAX_TOKENS)
    llm_a, first = run(tiny_models["llama"], params=params, num_kv_blocks=256,
                       speculative_config=ngram(3))
    _, second = run(tiny_models["llama"], params=params, num_kv_blocks=256,
                    speculative_config=ngram(3))
    assert first == second
    assert all(len(t) == MAX_TOKENS for t in first)


def test_rows_with_logprobs_or_penalties_do_not_draft(tiny_models):
    params = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3)]
    llm, tokens = run(tiny_models["llama"], prompts=PROMPTS[:2], params=params,
                      num_kv_blocks=256, speculative_config=ngram(4))
    _, plain = run(tiny_models["llama"], prompts=PROMPTS[:2], params=params, num_kv_blocks=256)
    assert tokens == plain
    assert llm.stats().spec_decode_num_drafts == 0


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa"},
     "speculative method must be one of ngram, draft_model, eagle, eagle3, got 'medusa'"),
    ({"method": "eagle"}, "method 'eagle' needs a draft 'model'"),
    ({"num_speculative_tokens": 9}, "num_speculative_tokens must be in [1, 8], got 9"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max (2) must be at least prompt_lookup_min (3)"),
    ({"lookup": 2}, "unknown speculative_config keys: lookup (known: adaptive, "
     "draft_gpus, draft_tensor_parallel_size, method, model, num_speculative_tokens, "
     "placement, prompt_lookup_max, prompt_lookup_min)"),
])
def test_bad_speculative_configs_are_refused_at_start_up(tiny_models, config, message):
    with pytest.raises(ValueError) as error:
        LLM(str(tiny_models["llama"]), device="cpu", speculative_config=config)
    assert str(error.value) == message


@pytest.mark.ray
def test_tensor_parallel_2_verifies_the_same_tokens(ray_session, tiny_models, expected):
    """Drafts are scheduled tokens: every rank computes them, rank 0 verifies."""
    llm = LLM(str(tiny_models["llama"]), device="cpu", block_size=4, num_kv_blocks=128,
              tensor_parallel_size=2, distributed_executor_backend="ray",
              speculative_config=ngram(3))
    try:
        llm.engine.speculator.proposer = oracle(expected, wrong=0.3)
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [out.token_ids for out in outputs] == expected
        assert llm.stats().spec_decode_num_accepted_tokens > 0
        llm.engine.scheduler.kv.check_integrity()
    finally:
        llm.engine.shutdown()


def test_the_engine_measures_speculation_against_plain_steps():
    metrics = EngineMetrics()
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3), metrics)
    speculator.lengths.costs = fitted(0.010, 0.001)
    a, b = (Sequence(r, [1, 2], SamplingParams()) for r in "ab")
    step = SchedulerOutput([ScheduledSequence(a, 4, [], False, [5, 6, 7]),
                            ScheduledSequence(b, 1, [], False)])
    speculator.observe(step, {"a": [5, 6, 9], "b": [4]}, seconds=0.016)
    assert (metrics.spec_decode_drafts, metrics.spec_decode_draft_tokens,
            metrics.spec_decode_accepted_tokens) == (1, 3, 2)
    assert metrics.spec_decode_accepted_per_position == [1, 1, 0]
    # 4 tokens; a plain step of 2 rows takes ~0.012 s for 2 of them; this step took 0.016
    assert metrics.spec_decode_speedup == pytest.approx(4 * 0.012 / 2 / 0.016, rel=0.05)


def draft(model, k: int, adaptive: bool = False) -> dict:
    return {"model": str(model), "num_speculative_tokens": k, "adaptive": adaptive}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_target_as_its_own_draft_is_accepted_and_exact(tiny_models, expected, k):
    llm, tokens = run(tiny_models["llama"], num_kv_blocks=256,
                      speculative_config=draft(tiny_models["llama"], k))
    assert tokens == expected
    stats = llm.stats()
    assert stats.spec_decode_num_drafts > 0
    rate = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    assert rate >= 0.95
    # the tokens the draft caught up on (its prompts first) reach the cost model, apart
    costs = llm.engine.speculator.lengths.costs
    assert costs.xtx[5, 5] > 0 and costs.xty[5] > 0


def test_an_unrelated_draft_changes_nothing_under_chunks_preemption_and_prefix_hits(
        tiny_models, expected):
    llm, tokens = run(tiny_models["llama"], num_kv_blocks=40, max_num_batched_tokens=16,
                      speculative_config=draft(tiny_models["llama-draft"], 4))
    assert tokens == expected
    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens < 0.2 * stats.spec_decode_num_draft_tokens
    again = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert again == expected and llm.stats().prefix_cache_hits > 0
    # and the target as its draft, under the same pressure
    llm, tokens = run(tiny_models["llama"], num_kv_blocks=40, max_num_batched_tokens=16,
                      speculative_config=draft(tiny_models["llama"], 3))
    assert tokens == expected
    stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens


def test_a_draft_of_another_vocabulary_is_refused_at_start_up(tiny_models):
    with pytest.raises(ValueError) as error:
        LLM(str(tiny_models["llama"]), device="cpu",
            speculative_config=draft(tiny_models["qwen2"], 2))
    assert str(error.value) == ("the draft model's vocabulary (999 tokens) differs from the "
                                "target's (1001): it must share the tokenizer")


@pytest.mark.ray
def test_a_draft_actor_proposes_as_the_worker_draft_does(ray_session, tiny_models, expected):
    """The draft in an actor of its own, under chunks, preemption and prefix hits: the same
    tokens, the target as its own draft accepted as in the worker."""
    config = draft(tiny_models["llama"], 4) | {"placement": "actor", "draft_gpus": 0.5}
    llm, tokens = run(tiny_models["llama"], num_kv_blocks=26, max_num_batched_tokens=16,
                      speculative_config=config)
    assert tokens == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.executor.worker.draft is None  # not in the worker
    stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens
    again = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert again == expected and llm.stats().prefix_cache_hits > 0


@pytest.mark.ray
@pytest.mark.parametrize("placement", ["worker", "actor"])
def test_a_draft_model_serves_a_tensor_parallel_2_target(ray_session, tiny_models, expected,
                                                          placement):
    """A draft model beside a target of two shards: in rank 0's worker (its drafts broadcast
    to the other rank) or as an actor of its own."""
    llm = LLM(str(tiny_models["llama"]), device="cpu", block_size=4, num_kv_blocks=128,
              tensor_parallel_size=2, distributed_executor_backend="ray",
              speculative_config=draft(tiny_models["llama"], 2) | {"placement": placement})
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [out.token_ids for out in outputs] == expected
        stats = llm.stats()
        assert stats.spec_decode_num_draft_tokens > 0
        assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens
        llm.engine.scheduler.kv.check_integrity()
    finally:
        llm.engine.shutdown()


def test_a_catalog_draft_of_another_vocabulary_is_refused_before_it_is_pulled(tiny_models,
                                                                              tmp_path):
    with pytest.raises(ValueError) as error:
        LLM(str(tiny_models["llama"]), device="cpu", cache_dir=str(tmp_path),
            speculative_config={"model": "qwen2.5-coder-0.5b-instruct"})
    assert str(error.value) == (
        "the draft model 'qwen2.5-coder-0.5b-instruct' has a vocabulary of 151936 tokens, the "
        "target 1001: a draft must share the target's tokenizer (no catalog model shares its "
        "vocabulary)")
    assert list(tmp_path.iterdir()) == []  # nothing pulled


class EveryThird:
    """``DraftLength.choose`` that drafts k for everyone one call in three, else nothing."""

    def __init__(self, k: int) -> None:
        self.k, self.calls = k, 0

    def __call__(self, request_ids, batch_size, num_tokens=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return dict.fromkeys(request_ids, self.k if self.calls % 3 == 0 else 0)


def test_a_step_without_drafts_is_the_plain_step_and_never_runs_the_draft(tiny_models,
                                                                          expected):
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=256, decode_steps=4,
              speculative_config=draft(tiny_models["llama"], 3, adaptive=True))
    llm.engine.speculator.lengths.choose = EveryThird(3)
    worker = llm.engine.executor.worker
    forwards = []
    model = worker.draft.model

    def counted(*args):  # type: ignore[no-untyped-def]
        forwards[-1][2] += 1
        return model(*args)

    worker.draft.model = type("Counted", (), {"__call__": staticmethod(counted),
                                              "__getattr__": lambda _, n: getattr(model, n)})()
    execute = worker.execute

    def recorded(step):  # type: ignore[no-untyped-def]
        forwards.append([step.num_steps, any(i.num_model_drafts for i in step.scheduled), 0])
        return execute(step)

    worker.execute = recorded
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [out.token_ids for out in outputs] == expected
    drafting = [f for f in forwards if f[1]]
    plain = [f for f in forwards if not f[1]]
    assert drafting and all(steps == 1 and count > 0 for steps, _, count in drafting)
    assert all(count == 0 for _, _, count in plain)  # the draft never runs without drafts
    assert any(steps > 1 for steps, _, _ in plain)  # multi-step calls between drafting steps
    stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens
