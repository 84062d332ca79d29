"""Admitting prompts: without chunked prefill a prompt waits for a step with room for all of
it; with a scheduler delay factor new prompts wait while others run (vLLM's rule)."""

import pytest

from kvstore.kv_cache_manager import KVCacheManager
from router.prefill_delay import PrefillDelay
from router.sampling_params import SamplingParams
from router.scheduler import Scheduler, SchedulerConfig
from router.sequence import Sequence


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def seq(request_id, num_prompt, first=0, arrival=0.0):
    return Sequence(request_id, list(range(first, first + num_prompt)),
                    SamplingParams(max_tokens=8), eos_token_ids=frozenset({999}),
                    arrival_time=arrival)


def plan(output):
    return [(s.seq.request_id, s.num_new_tokens) for s in output.scheduled]


def step(sched):
    output = sched.schedule()
    sampled = {s.seq.request_id: [7] for s in output.scheduled
               if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens}
    sched.update(output, sampled)
    sched.kv.check_integrity()
    return plan(output)


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it():
    config = SchedulerConfig(64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched = Scheduler(config, KVCacheManager(32, 4))
    sched.add(seq("a", 6))
    sched.add(seq("b", 4, first=50))
    sched.add(seq("c", 1, first=90))
    assert step(sched) == [("a", 6)]  # b (4) does not fit the 2 left: b and c behind it wait
    assert step(sched) == [("a", 1), ("b", 4), ("c", 1)]
    chunked = Scheduler(SchedulerConfig(64, max_num_batched_tokens=8), KVCacheManager(32, 4))
    chunked.add(seq("a", 6))
    chunked.add(seq("b", 4, first=50))
    assert step(chunked) == [("a", 6), ("b", 2)]


def test_the_delay_rule_waits_factor_times_the_last_step():
    clock = Clock()
    delay = PrefillDelay(0.5, clock)
    assert delay.admits(oldest_arrival=None, any_running=True)  # nothing waits
    clock.now = 10.2  # the last step took 0.2 s: a prompt waits 0.1 s while others run
    assert not delay.admits(oldest_arrival=10.15, any_running=True)  # waited 0.05 s
    clock.now = 10.4  # this step took 0.2 s too; the prompt has waited 0.25 s now
    assert delay.admits(oldest_arrival=10.15, any_running=True)
    clock.now = 10.41
    assert delay.admits(oldest_arrival=10.41, any_running=False)  # nothing runs: no wait
    assert PrefillDelay(0.0, clock).admits(oldest_arrival=clock.now, any_running=True)
    with pytest.raises(ValueError, match="scheduler_delay_factor must be >= 0, got -1"):
        PrefillDelay(-1)


def test_a_burst_prefills_together_under_the_delay():
    clock = Clock()
    config = SchedulerConfig(64, max_num_batched_tokens=64, scheduler_delay_factor=1.0)
    sched = Scheduler(config, KVCacheManager(64, 4))
    sched.prefill_delay.clock = clock
    sched.add(seq("a", 4, arrival=clock.now))
    assert step(sched) == [("a", 4)]  # nothing runs: at once
    clock.now += 0.1
    sched.add(seq("b", 4, first=40, arrival=clock.now))
    assert step(sched) == [("a", 1)]  # b has waited 0 s of the 0.1 s
    clock.now += 0.05
    sched.add(seq("c", 4, first=80, arrival=clock.now))
    # the last step took 0.05 s and b has waited that long: b and c (just come) prefill together
    assert step(sched) == [("a", 1), ("b", 4), ("c", 4)]
