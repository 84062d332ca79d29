"""Loads priced at the rates the running engine measures: the start-up figures a prior that
measured copies and prefill steps move, and a load priced behind the loads queued before it.
Exact rates, and which sequence loads and which recomputes."""

import pytest

from kvstore.transfers import TransferReport
from router.kv_pricing import TransferRates
from router.live_rates import HALF_LIFE_S, PRIOR_S, LiveRates
from router.sampling_params import SamplingParams
from router.sequence import Sequence
from tests.router.test_tier_timeouts_and_pricing import BS, FAST, PROMPT, make, step

OTHER = list(range(300, 313))  # 13 tokens: 3 full blocks, none shared with PROMPT


def test_measured_copies_move_the_start_up_rate_by_their_time():
    live = LiveRates(TransferRates(1000.0, 1e9, 1000))
    assert live.current().host_copy_bytes_per_s == pytest.approx(1e9)
    live.observe_copies(2_000_000, HALF_LIFE_S)  # 2 MB/s for a half-life: the prior halves
    expected = (1e9 * PRIOR_S / 2 + 2_000_000) / (PRIOR_S / 2 + HALF_LIFE_S)
    assert live.current().host_copy_bytes_per_s == pytest.approx(expected)
    live.observe_copies(0, 0.0)  # nothing copied: nothing learnt
    assert live.current().host_copy_bytes_per_s == pytest.approx(expected)


def test_only_steps_that_were_mostly_prompt_move_the_prefill_rate():
    live = LiveRates(TransferRates(1000.0, 1e9, 1000))
    live.observe_step(prompt_tokens=32, total_tokens=32, seconds=1.0)  # too few to say
    live.observe_step(prompt_tokens=100, total_tokens=300, seconds=1.0)  # mostly decodes
    assert live.current().prefill_tokens_per_s == pytest.approx(1000.0)
    live.observe_step(prompt_tokens=200, total_tokens=210, seconds=HALF_LIFE_S)
    assert live.current().prefill_tokens_per_s == pytest.approx(
        (1000.0 * PRIOR_S / 2 + 200) / (PRIOR_S / 2 + HALF_LIFE_S))


def evicted(sched, prompts):
    """Each prompt's 3 full blocks in the host tier, gone from the device."""
    for index, prompt in enumerate(prompts):
        sched.add(Sequence(f"a{index}", prompt, SamplingParams(max_tokens=1)))
    step(sched)
    step(sched)  # the write-through
    sched.kv.reset_prefix_cache()


def test_slow_copies_measured_while_serving_turn_loads_into_recomputes():
    sched = make(rates=FAST)
    evicted(sched, [PROMPT])
    # 1 KB a second measured for 10 s: a 3-block load takes ~3 s against 12 us of recompute
    sched.apply_transfers(TransferReport(copied_bytes=10_000, copy_seconds=10.0))
    sched.add(Sequence("b", PROMPT + [5, 6], SamplingParams(max_tokens=1)))
    ran, transfers = step(sched)
    assert ran == [("b", 0, 15)] and transfers is None
    assert sched.kv.stats.host_hits == 0


def test_a_load_is_priced_behind_the_loads_queued_before_it():
    # a block copies in 1 ms; 12 tokens recompute in 5 ms: one 3-block load pays (3 ms), a
    # second behind it does not (6 ms)
    sched = make(rates=FAST)
    evicted(sched, [PROMPT, OTHER])
    # (at these rates a load saves too little to write blocks through: they were written first)
    sched.rates = sched.loads.rates = LiveRates(TransferRates(12 / 0.005, 1e6, 1000))
    sched.add(Sequence("b", PROMPT + [5, 6], SamplingParams(max_tokens=1)))
    sched.add(Sequence("c", OTHER + [5, 6], SamplingParams(max_tokens=1)))
    ran, transfers = step(sched)
    assert ran == [("b", 12, 3), ("c", 0, 15)]  # b runs on its load, c recomputes
    assert [load.request_id for load in transfers.loads] == ["b"]
    assert sched.rates.queued == {"b": 3}
    # the load's report: nothing queued
    step(sched, TransferReport(loaded={"b": 3}))
    assert sched.rates.queued == {}
    assert sched.kv.stats.host_hits == 3 * BS
