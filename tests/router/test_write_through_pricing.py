"""The write-through priced like the loads (router/tier_loads.py, kvstore/tiers.py): blocks go
to the host tier only while storing one and loading it back cost at most half its recompute
(the store: the start-up probe's copy out and the host's time planning it), but for one
request in ``WRITE_PROBE_EVERY`` (so that loads are still measured) and a preempted sequence's
swap (priced on its own). The start-up probe's loads' rate is where the loads' price starts."""

import pytest

from cluster.engine.kv_tiers import describe_rates
from kvstore.block_hash import hash_full_blocks
from kvstore.host_tier import HostTier
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.tiers import TierManager, writes_anyway
from kvstore.transfers import KVTransfers, StepCost
from router.kv_pricing import TransferRates, load_pays, store_pays
from router.live_rates import HALF_LIFE_S, PRIOR_LOAD_BLOCKS, LiveRates
from router.sampling_params import SamplingParams
from router.sequence import Sequence
from tests.router.test_tier_timeouts_and_pricing import BS, PROMPT, SLOW, make, step

RATES = TransferRates(1000.0, 1e6, 1000)  # a block copies in 1 ms, its 4 tokens take 4 ms


def test_a_block_is_written_only_where_its_load_would_beat_its_recompute():
    assert store_pays(None, BS) and store_pays(RATES, BS)
    assert not store_pays(SLOW, BS)  # a block copies in 1 s, its tokens compute in 4 us
    assert not store_pays(TransferRates(1000.0, 1e6, 1000, load_bytes_per_s=2e5), BS)  # 5 ms
    # a load must cost at most half the recompute: 2 ms of 4 is written, 2.5 ms is not
    assert store_pays(TransferRates(1000.0, 1e6, 1000, load_bytes_per_s=5e5), BS)
    assert not store_pays(TransferRates(1000.0, 1e6, 1000, load_bytes_per_s=4e5), BS)
    assert load_pays(TransferRates(1000.0, 1e6, 1000, load_bytes_per_s=4e5), 1, BS)


def test_a_block_s_store_counts_with_its_load():
    # a load of 1 ms and a store of 1 ms: 2 ms of the 4 ms recompute is written, 1.5 ms more
    # is not; a store of 0 (the CPU: unprobed) prices the load alone
    assert store_pays(TransferRates(1000.0, 1e6, 1000, store_seconds_per_block=1e-3), BS)
    assert not store_pays(TransferRates(1000.0, 1e6, 1000, store_seconds_per_block=1.5e-3), BS)
    assert TransferRates(1000.0, 1e6, 1000, store_seconds_per_block=2e-3).store_seconds(3) == (
        pytest.approx(6e-3))
    with pytest.raises(ValueError, match="store cost"):
        TransferRates(1000.0, 1e6, 1000, store_seconds_per_block=-1.0)


def test_the_host_s_planning_is_added_to_a_probed_store():
    sched = make(rates=TransferRates(1000.0, 1e6, 1000, store_seconds_per_block=0.5e-3))
    counters = sched.kv.tiers.counters
    sched.schedule()
    assert sched.kv.tiers.write_through is True  # 1 ms + 0.5 ms of 4 ms
    # the host took 0.6 ms a block to plan its stores: 2.1 ms of 4 ms, no longer written
    counters.stored_to_host, counters.store_plan_seconds = 10, 6e-3
    assert counters.plan_seconds_per_block() == pytest.approx(0.6e-3)
    sched.schedule()
    assert sched.kv.tiers.write_through is False
    # unprobed (the CPU's rates): the host's time is not priced, whatever it was
    cpu = make(rates=RATES)
    cpu.kv.tiers.counters.stored_to_host, cpu.kv.tiers.counters.store_plan_seconds = 1, 10.0
    cpu.schedule()
    assert cpu.kv.tiers.write_through is True


def test_take_times_its_planning_of_stores_only():
    tiers = TierManager(HostTier(4), None, BS)
    kv = KVCacheManager(8, BS, tiers=tiers)
    assert tiers.take(kv.pool) is None and tiers.counters.store_plan_seconds == 0.0
    kv.allocate_slots("a", 0, 8)
    kv.cache_blocks("a", PROMPT, 8)
    assert tiers.take(kv.pool) == KVTransfers(stores=[(0, 0), (1, 1)])
    assert tiers.counters.store_plan_seconds > 0.0 and tiers.counters.stored_to_host == 2


def test_with_the_write_through_off_only_one_request_in_sixteen_is_written():
    sched = make(rates=SLOW)
    assert not writes_anyway("a") and writes_anyway("f")
    sched.add(Sequence("a", PROMPT, SamplingParams(max_tokens=1)))
    step(sched)
    ran, transfers = step(sched)  # where the write-through would be
    assert sched.kv.tiers.write_through is False
    assert transfers is None and sched.kv.tiers.counters.not_written == 3
    assert len(sched.kv.tiers.host) == 0
    other = [t + 1000 for t in PROMPT]
    sched.add(Sequence("f", other, SamplingParams(max_tokens=1)))
    step(sched)
    ran, transfers = step(sched)
    assert transfers == KVTransfers(stores=[(4, 0), (5, 1), (6, 2)])  # a kept 0-3
    assert [sched.kv.tiers.host.lookup(h, other[i * BS:(i + 1) * BS]).slot
            for i, h in enumerate(hash_full_blocks(other, BS))] == [0, 1, 2]


def test_a_swap_out_is_written_with_the_write_through_off():
    tiers = TierManager(HostTier(4), None, BS)
    kv = KVCacheManager(8, BS, tiers=tiers)
    tiers.write_through = False
    kv.allocate_slots("a", 0, 8)
    kv.cache_blocks("a", PROMPT, 8)
    assert tiers.pending == {} and tiers.counters.not_written == 2
    tiers.swap_out(kv.req_blocks["a"])
    assert tiers.take(kv.pool) == KVTransfers(stores=[(0, 0), (1, 1)])


def test_the_write_through_follows_the_live_rates():
    sched = make(rates=RATES)
    sched.schedule()
    assert sched.kv.tiers.write_through is True
    # a step that loaded a block and computed nothing took 1 s: a load now costs ~0.8 s
    sched.rates.observe_step_cost(StepCost(0, 1, 1, 1.0))
    sched.schedule()
    assert sched.kv.tiers.write_through is False
    # prefill steps slow down to 0.064 tokens/s: 4 tokens cost 62 s, the load pays again
    sched.rates.observe_step_cost(StepCost(64, 64, 0, 1000 * HALF_LIFE_S))
    sched.schedule()
    assert sched.kv.tiers.write_through is True


def test_the_loads_price_starts_at_the_start_up_probe_s():
    live = LiveRates(TransferRates(1000.0, 1e9, 1000, load_bytes_per_s=2e6))
    assert live.loads.amount == PRIOR_LOAD_BLOCKS * 1000
    assert live.loads.seconds == pytest.approx(PRIOR_LOAD_BLOCKS * 1000 / 2e6)
    assert live.current().load_bytes_per_s == pytest.approx(2e6)
    assert live.current().load_seconds(1) == pytest.approx(1000 / 2e6)
    assert LiveRates(RATES).current().load_seconds(1) == pytest.approx(1e-3)  # no probe


def test_the_engine_logs_the_start_up_prices_and_what_they_decide():
    small = TransferRates(300_000.0, 5.4e10, 196_608, store_seconds_per_block=25e-6)
    assert describe_rates(small, 16) == (
        "host KV tier: a block stores in 25 us, loads in 4 us (copies 54.0 GB/s) and "
        "recomputes in 53 us (300,000 prompt tokens/s): a store and a load save too little, so "
        "blocks are not written through (but for one request in 16, to measure loads again) "
        "while the rates stay so")
    dear_loads = TransferRates(300_000.0, 5.4e10, 196_608, load_bytes_per_s=2e9)
    assert describe_rates(dear_loads, 16).startswith(
        "host KV tier: a block stores in 0 us, loads in 98 us (copies 54.0 GB/s, a step's loads "
        "2.0 GB/s) and recomputes in 53 us")
    assert describe_rates(TransferRates(1000.0, 1e6, 1000), 4) == (
        "host KV tier: a block stores in 0 us, loads in 1000 us (copies 0.0 GB/s) and "
        "recomputes in 4000 us (1,000 prompt tokens/s): blocks are written through")
