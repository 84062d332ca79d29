"""Several decode steps per call: slots reserved ahead, tokens after a stop dropped."""

from kvstore.kv_cache_manager import KVCacheManager
from router.sampling_params import SamplingParams
from router.scheduler import Scheduler, SchedulerConfig
from router.sequence import FinishReason, Sequence


def make(num_blocks=16, decode_steps=4, max_model_len=64):
    config = SchedulerConfig(max_model_len, 64, 8, decode_steps=decode_steps)
    return Scheduler(config, KVCacheManager(num_blocks, 4))


def seq(request_id, num_prompt, max_tokens=16, first=0, **params):
    prompt = list(range(first, first + num_prompt))
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                    eos_token_ids=frozenset({999}))


def prefill(sched, *seqs):
    for s in seqs:
        sched.add(s)
    output = sched.schedule()
    assert output.num_steps == 1  # prompts are not decodes
    sched.update(output, {s.request_id: [7] for s in seqs})


def test_a_decoding_batch_runs_several_steps_with_every_slot_reserved():
    sched = make()
    a, b = seq("a", 6), seq("b", 3, first=50)
    prefill(sched, a, b)  # a: 7 tokens in blocks 0, 1; b: 4 tokens in block 2
    output = sched.schedule()
    assert output.num_steps == 4
    # a computes positions 6..9 (block 1 then 3), b positions 3..6 (block 2 then 4)
    assert [(s.seq.request_id, s.num_new_tokens, s.new_block_ids) for s in output.scheduled] == [
        ("a", 1, [3]), ("b", 1, [4])]
    assert sched.update(output, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}) == []
    assert a.output_token_ids == [7, 1, 2, 3, 4] and a.num_computed_tokens == a.num_tokens - 1
    assert b.output_token_ids == [7, 5, 6, 7, 8] and b.num_computed_tokens == b.num_tokens - 1
    sched.kv.check_integrity()


def test_tokens_after_a_stop_or_the_length_limit_are_dropped():
    sched = make()
    eos, short, stop = seq("eos", 4), seq("short", 4, max_tokens=3, first=20), seq(
        "stop", 4, first=40, stop_token_ids=[5])
    prefill(sched, eos, short, stop)
    output = sched.schedule()
    assert output.num_steps == 4  # "short" needs 2 more, the others up to 15
    finished = sched.update(output, {"eos": [1, 999, 2, 3], "short": [1, 2, 3, 4],
                                     "stop": [5, 6, 7, 8]})
    assert [(s.request_id, s.finish_reason, s.output_token_ids) for s in finished] == [
        ("eos", FinishReason.STOP, [7, 1, 999]), ("short", FinishReason.LENGTH, [7, 1, 2]),
        ("stop", FinishReason.STOP, [7, 5])]
    assert sched.kv.num_used_blocks == 0
    sched.kv.check_integrity()


def test_a_call_runs_no_step_that_nobody_needs():
    sched = make()
    a, b = seq("a", 4, max_tokens=3), seq("b", 4, max_tokens=2, first=20)
    prefill(sched, a, b)
    output = sched.schedule()
    assert output.num_steps == 2  # a needs 2 more tokens, b 1
    finished = sched.update(output, {"a": [1, 2], "b": [3, 4]})
    assert [(s.request_id, s.output_token_ids) for s in finished] == [
        ("a", [7, 1, 2]), ("b", [7, 3])]


def test_one_step_when_someone_waits_samples_with_penalties_or_the_pool_is_short():
    sched = make()
    prefill(sched, seq("a", 6))
    sched.add(seq("b", 3, first=50))
    assert sched.schedule().num_steps == 1  # b waits to be admitted

    sched = make()
    prefill(sched, seq("a", 6, repetition_penalty=1.2))
    assert sched.schedule().num_steps == 1  # a penalty needs every token before it

    sched = make()  # min_tokens masks stops by the output's length: one step at a time until
    a = seq("a", 6, min_tokens=3)
    prefill(sched, a)
    output = sched.schedule()
    assert output.num_steps == 1
    sched.update(output, {"a": [8]})
    output = sched.schedule()
    assert output.num_steps == 1
    sched.update(output, {"a": [9]})
    assert a.num_output_tokens == 3 and sched.schedule().num_steps == 4  # then as many as fit

    sched = make(num_blocks=2)
    prefill(sched, seq("a", 6))  # 7 tokens in both blocks: 4 more steps need a third
    assert sched.schedule().num_steps == 1

    sched = make(max_model_len=9)
    prefill(sched, seq("a", 6))
    assert sched.schedule().num_steps == 2  # the model's length allows 2 more tokens


def make_lookahead(num_blocks=16, decode_steps=4, max_model_len=64):
    config = SchedulerConfig(max_model_len, 64, 8, decode_steps=decode_steps,
                             decode_lookahead=True)
    return Scheduler(config, KVCacheManager(num_blocks, 4))


def test_a_lookahead_step_gets_the_slot_after_the_call():
    sched = make_lookahead()
    a, c = seq("a", 6), seq("c", 4, first=30)
    prefill(sched, a, c)  # a: 7 tokens, 6 computed in blocks 0, 1; c: 5, 4 computed in block 2
    output = sched.schedule()
    assert (output.num_steps, output.lookahead) == (4, True)
    # a computes positions 6..9 and looks ahead to 10: block 3 (8..11) holds 8..10;
    # c computes 4..7 (block 4) and looks ahead to 8: a block of its own, 5
    assert [(s.seq.request_id, s.new_block_ids) for s in output.scheduled] == [
        ("a", [3]), ("c", [4, 5])]
    sched.update(output, {"a": [1, 2, 3, 4], "c": [5, 6, 7, 8]})
    # the next call starts at the lookahead's slot, already allocated
    output = sched.schedule()
    assert (output.num_steps, output.lookahead) == (4, True)
    assert [(s.seq.request_id, s.new_block_ids) for s in output.scheduled] == [
        ("a", [6]), ("c", [7])]
    sched.kv.check_integrity()


def test_a_lookahead_when_some_sequence_outlives_the_call():
    sched = make_lookahead()
    a, b = seq("a", 6, max_tokens=5), seq("b", 3, first=50)
    prefill(sched, a, b)  # a: 7 tokens, 6 computed in blocks 0, 1; b: 4, 3 computed in block 2
    output = sched.schedule()  # a wants 4 more tokens: the call is its last, not b's
    assert (output.num_steps, output.lookahead) == (4, True)
    # a computes 6..9 and looks ahead to 10 (block 3: 8..11); b computes 3..6 and looks ahead
    # to 7 (block 4: 4..7)
    assert [(s.seq.request_id, s.new_block_ids) for s in output.scheduled] == [
        ("a", [3]), ("b", [4])]
    finished = sched.update(output, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]})
    assert [(s.request_id, s.finish_reason) for s in finished] == [("a", FinishReason.LENGTH)]
    assert sched.kv.num_used_blocks == 2  # a's blocks, its lookahead's slot too, are free
    output = sched.schedule()  # b goes on from its lookahead's position, looking ahead again
    assert (output.num_steps, output.lookahead) == (4, True)
    # its next block is 5: blocks freed go to the back of the free queue (cached prefixes)
    assert [(s.seq.request_id, s.new_block_ids) for s in output.scheduled] == [("b", [5])]
    sched.kv.check_integrity()


def test_no_lookahead_when_every_sequence_may_end_in_the_call_or_the_pool_is_short():
    sched = make_lookahead()
    prefill(sched, seq("a", 6, max_tokens=5), seq("b", 3, first=50, max_tokens=4))
    output = sched.schedule()  # a wants 4 more tokens, b 3: the call may be the last of both
    assert (output.num_steps, output.lookahead) == (4, False)

    sched = make_lookahead(max_model_len=11)
    prefill(sched, seq("a", 6))  # 7 tokens: the model's length leaves room for 4
    assert (sched.schedule().num_steps, sched.schedule().lookahead) == (4, False)

    # 4 computed tokens in block 0: 4 steps fill block 1, their lookahead would need a third
    sched = make_lookahead(num_blocks=2)
    prefill(sched, seq("c", 4))
    output = sched.schedule()
    assert (output.num_steps, output.lookahead) == (4, False)
    assert [s.new_block_ids for s in output.scheduled] == [[1]]

    sched = make()  # off unless asked
    prefill(sched, seq("a", 6))
    assert sched.schedule().lookahead is False
