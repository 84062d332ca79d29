import pytest

from kvstore.kv_cache_manager import KVCacheManager
from router.sampling_params import SamplingParams
from router.scheduler import Scheduler, SchedulerConfig
from router.sequence import FinishReason, Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, budget=64, max_seqs=8, chunk=0, max_model_len=64):
    config = SchedulerConfig(max_model_len, budget, max_seqs, max_prefill_chunk=chunk)
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def seq(request_id, num_prompt, max_tokens=8, first=0, **params):
    prompt = list(range(first, first + num_prompt))
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                    eos_token_ids=frozenset({999}))


def plan(output):
    return [(s.seq.request_id, s.num_new_tokens, s.new_block_ids, s.is_new)
            for s in output.scheduled]


def step(sched, token=7):
    """Schedule, then pretend the model sampled ``token`` for every sequence that is caught up."""
    output = sched.schedule()
    sampled = {s.seq.request_id: [token] for s in output.scheduled
               if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens}
    finished = sched.update(output, sampled)
    sched.kv.check_integrity()
    return output, finished


def test_prefill_then_decode_mixes_new_prompts_into_running_steps():
    sched = make()
    sched.add(seq("a", 6))
    output, _ = step(sched)
    assert plan(output) == [("a", 6, [0, 1], True)]
    sched.add(seq("b", 3, first=50))
    output, _ = step(sched)
    assert plan(output) == [("a", 1, [], False), ("b", 3, [2], True)]
    output, _ = step(sched)
    assert plan(output) == [("a", 1, [], False), ("b", 1, [], False)]
    output, _ = step(sched)  # a's 9th token and b's 5th open new blocks
    assert plan(output) == [("a", 1, [3], False), ("b", 1, [4], False)]


def test_budget_chunks_a_long_prompt_across_steps():
    sched = make(budget=5)
    sched.add(seq("a", 12))
    sched.add(seq("b", 2, first=50))
    assert plan(step(sched)[0]) == [("a", 5, [0, 1], True)]
    assert plan(step(sched)[0]) == [("a", 5, [2], False)]
    # a's last 2 prompt tokens, then b fills the rest of the budget
    assert plan(step(sched)[0]) == [("a", 2, [], False), ("b", 2, [3], True)]
    assert sched.running[0].output_token_ids == [7]


def test_max_prefill_chunk_and_max_num_seqs():
    sched = make(chunk=3, max_seqs=1)
    sched.add(seq("a", 7))
    sched.add(seq("b", 2))
    assert plan(step(sched)[0]) == [("a", 3, [0], True)]
    assert plan(step(sched)[0]) == [("a", 3, [1], False)]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_finish_on_max_tokens_eos_and_stop_token_frees_blocks():
    sched = make()
    for request_id, first, params in [("len", 0, {"max_tokens": 2}), ("eos", 10, {}),
                                      ("stop", 20, {"stop_token_ids": [5]}),
                                      ("ign", 30, {"ignore_eos": True, "max_tokens": 2})]:
        sched.add(seq(request_id, 4, first=first, **params))
    output = sched.schedule()
    finished = sched.update(output, {"len": [1], "eos": [999], "stop": [5], "ign": [999]})
    assert [(s.request_id, s.finish_reason, s.stop_reason) for s in finished] == [
        ("eos", FinishReason.STOP, None), ("stop", FinishReason.STOP, 5)]
    _, finished = step(sched, token=999)
    assert [(s.request_id, s.finish_reason, s.output_token_ids) for s in finished] == [
        ("len", FinishReason.STOP, [1, 999]), ("ign", FinishReason.LENGTH, [999, 999])]
    assert not sched.has_unfinished() and sched.kv.num_used_blocks == 0
    # the released ids reach the workers with the next schedule
    assert sched.schedule().released_ids == ["len", "ign"]


def test_preemption_recomputes_the_newest_and_resumes_it_with_its_cached_prefix():
    sched = make(num_blocks=4, block_size=2, max_model_len=16)
    sched.add(seq("old", 4, max_tokens=3))
    sched.add(seq("new", 4, max_tokens=2, first=10))
    assert plan(step(sched)[0]) == [("old", 4, [0, 1], True), ("new", 4, [2, 3], True)]
    # old needs a third block and there is none: the newest is preempted, its tail freed first
    output, _ = step(sched)
    assert output.preempted_ids == ["new"] and plan(output) == [("old", 1, [3], False)]
    assert output.released_ids == ["new"]
    victim = sched.waiting[0]
    assert (victim.status, victim.num_computed_tokens, victim.output_token_ids) == (
        SequenceStatus.WAITING, 0, [7])
    output, finished = step(sched)
    assert [s.request_id for s in finished] == ["old"]
    # new comes back as new to the workers; its first block (tokens 10, 11) is still cached
    output, finished = step(sched)
    assert plan(output) == [("new", 3, [2, 3, 1], True)] and output.released_ids == ["old"]
    assert (finished[0].request_id, finished[0].num_preemptions) == ("new", 1)
    assert sched.num_preemptions == 1
    assert sched.kv.stats.queries == 4 + 4 + 5 and sched.kv.stats.hits == 2


def test_abort_frees_everything_at_once():
    sched = make()
    sched.add(seq("a", 6))
    sched.add(seq("w", 6, first=30))
    step(sched)
    assert sched.finish("a", FinishReason.ABORT).finish_reason is FinishReason.ABORT
    assert sched.finish("w", FinishReason.ABORT).request_id == "w"
    assert sched.finish("nope", FinishReason.ABORT) is None
    assert sched.kv.num_used_blocks == 0 and not sched.has_unfinished()
    sched.kv.check_integrity()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"n": 0}, "n must be in [1, 128], got 0"),
    ({"stop": [""]}, "stop strings must not be empty"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in [0, max_tokens=4], got 5"),
    ({"min_tokens": -1}, "min_tokens must be in [0, max_tokens=16], got -1"),
])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == message


def test_a_shared_prefix_arriving_together_is_computed_once():
    sched = make()
    sched.add(seq("a", 10))
    sched.add(seq("b", 10))  # the same prompt: its blocks are a's, still being computed
    sched.add(seq("c", 3, first=50))  # unrelated: admitted past the waiting b
    output, _ = step(sched)
    assert plan(output) == [("a", 10, [0, 1, 2], True), ("c", 3, [3], True)]
    assert [s.request_id for s in sched.waiting] == ["b"]
    output, _ = step(sched)  # a's two full blocks are cached now: b hits them
    assert plan(output) == [("a", 1, [], False), ("c", 1, [], False),
                            ("b", 2, [0, 1, 4], True)]
    assert sched.running[-1].num_cached_tokens == 8
    assert sched.kv.stats.hits == 8


def test_a_waiting_prefix_sharer_keeps_its_place_until_chunks_are_cached():
    sched = make(budget=6)
    sched.add(seq("a", 13))
    sched.add(seq("b", 13))
    sched.add(seq("c", 13))
    # a's prompt is prefilled in chunks; b and c wait for all of its blocks, not a partial hit
    assert plan(step(sched)[0]) == [("a", 6, [0, 1], True)]
    assert plan(step(sched)[0]) == [("a", 6, [2], False)]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    # a's last token; b and c then get all three full blocks from the cache, in queue order
    assert plan(step(sched)[0]) == [("a", 1, [3], False), ("b", 1, [0, 1, 2, 4], True),
                                    ("c", 1, [0, 1, 2, 5], True)]
    assert sched.kv.stats.hits == 24


def test_a_prefix_owner_that_is_aborted_releases_its_waiters():
    sched = make(budget=4)
    sched.add(seq("a", 12))
    sched.add(seq("b", 12))
    assert plan(step(sched)[0]) == [("a", 4, [0], True)]
    sched.finish("a", FinishReason.ABORT)
    sched.kv.check_integrity()
    output, _ = step(sched)  # a cached its first block before it went: b hits it
    assert plan(output) == [("b", 4, [0, 1], True)]
    assert not sched.waiting
