"""Loads that never land or bring nothing fall back to recomputing; swaps and loads priced
against the recompute by the measured rates; blocks exported to and imported from another
replica's host tier. Exact slots, plans and counts; every tier conserved after each scenario."""

import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.disk_tier import DiskTier
from kvstore.host_tier import HostTier
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.tiers import TierManager
from kvstore.transfers import (
    BlockLoad,
    DiskWrite,
    HostImport,
    KVTransfers,
    StepCost,
    TransferReport,
)
from router.kv_pricing import TransferRates
from router.live_rates import HALF_LIFE_S, PRIOR_S, LiveRates
from router.sampling_params import SamplingParams
from router.scheduler import Scheduler, SchedulerConfig
from router.sequence import Sequence
from router.tier_loads import PROBE_EVERY

BS = 4
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks and one token
FAST = TransferRates(1000.0, 1e9, 1000)  # copies of microseconds against milliseconds
SLOW = TransferRates(1e6, 1e3, 1000)  # a block copies in 1 s, a token computes in 1 us


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=8, host_slots=8, rates=None, clock=None, timeout=5.0, disk=None):
    tiers = TierManager(HostTier(host_slots), disk, BS)
    kv = KVCacheManager(num_blocks, BS, tiers=tiers)
    config = SchedulerConfig(256, 64, 8, kv_load_timeout_s=timeout)
    return Scheduler(config, kv, rates=rates, clock=clock or Clock())


def step(sched, report=None):
    output = sched.schedule()
    transfers = sched.kv.take_transfers()
    ran = [(s.seq.request_id, s.seq.num_computed_tokens, s.num_new_tokens)
           for s in output.scheduled]
    if report is not None:
        sched.apply_transfers(report)
    sampled = {s.seq.request_id: [7] for s in output.scheduled
               if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens}
    sched.update(output, sampled)
    sched.kv.check_integrity()
    return ran, transfers


def cached_then_evicted(sched):
    """PROMPT's 3 blocks in host slots 0-2, gone from the device."""
    sched.add(Sequence("a", PROMPT, SamplingParams(max_tokens=1)))
    step(sched)
    step(sched)  # the write-through
    sched.kv.reset_prefix_cache()


def on_disk_then_evicted(sched):
    """PROMPT's 3 blocks on disk alone (another prompt's blocks took their 3 host slots),
    gone from the device: a load of them waits for its files, while others run."""
    cached_then_evicted(sched)
    sched.add(Sequence("x", list(range(600, 613)), SamplingParams(max_tokens=1)))
    step(sched)
    step(sched)  # x's write-through sends PROMPT's blocks on to disk
    sched.kv.reset_prefix_cache()


def test_a_load_that_never_lands_is_given_up_and_recomputed(tmp_path):
    clock = Clock()
    sched = make(clock=clock, host_slots=3, disk=DiskTier(tmp_path, "layout", 8))
    on_disk_then_evicted(sched)
    sched.add(Sequence("b", PROMPT + [5, 6], SamplingParams(max_tokens=1)))
    ran, transfers = step(sched)
    assert ran == [] and [(load.request_id, load.in_step) for load in transfers.loads] == [
        ("b", False)] and len(transfers.from_disk) == 3
    clock.now = 4.9
    assert step(sched)[0] == [] and list(sched.loading) == ["b"]
    clock.now = 5.0  # the timeout: its blocks are unpinned and it computes all 15 tokens
    ran, transfers = step(sched)
    # the workers drop its copies if they have not started (a load waiting for its files)
    assert ran == [("b", 0, 15)] and transfers.cancelled == ["b"]
    assert sched.loading == {} and sched.kv.tiers.host.index.num_pinned == 0
    # the late report of the given-up load changes nothing
    step(sched, TransferReport(loaded={"b": 3}))
    assert (sched.kv.stats.host_hits, sched.kv.stats.disk_hits) == (0, 0)


def test_a_load_that_brought_nothing_recomputes_and_does_not_load_again(tmp_path):
    sched = make(host_slots=3, disk=DiskTier(tmp_path, "layout", 8))
    on_disk_then_evicted(sched)
    sched.add(Sequence("b", PROMPT + [5, 6], SamplingParams(max_tokens=1)))
    step(sched)
    # the workers' copy failed (reported with no block intact): the tiers still hold the
    # blocks, but b recomputes rather than load them again
    ran, transfers = step(sched, TransferReport(loaded={"b": 0}))
    assert ran == []
    ran, transfers = step(sched)
    assert ran == [("b", 0, 15)] and (transfers is None or not transfers.loads)
    assert (sched.kv.stats.host_hits, sched.kv.stats.disk_hits) == (0, 0)
    assert sched.kv.tiers.host.index.num_pinned == 0


def test_a_host_tier_load_runs_its_sequence_in_the_same_step():
    sched = make()
    cached_then_evicted(sched)
    sched.add(Sequence("b", PROMPT + [5, 6], SamplingParams(max_tokens=1)))
    ran, transfers = step(sched)
    assert ran == [("b", 12, 3)]
    assert transfers.loads == [BlockLoad("b", [0, 1, 2], [4, 5, 6], in_step=True)]
    assert sched.kv.stats.host_hits == 12 and not sched.has_unfinished()


def test_a_load_dearer_than_its_recompute_is_not_started():
    sched = make(rates=SLOW)
    cached_then_evicted(sched)
    sched.add(Sequence("b", PROMPT + [5, 6], SamplingParams(max_tokens=1)))
    ran, transfers = step(sched)
    assert ran == [("b", 0, 15)] and transfers is None  # 3 s of copies against 12 us


def swaps_when_preempted(rates):
    """Two sequences that outgrow a pool of 6 blocks; the requests whose blocks went to the
    host tier when b (the newest) was preempted."""
    sched = make(num_blocks=6, host_slots=3, rates=rates)
    swapped = []
    swap_out = sched.kv.swap_out
    sched.kv.swap_out = lambda request_id: (swapped.append(request_id), swap_out(request_id))
    sched.add(Sequence("a", list(range(10, 17)), SamplingParams(max_tokens=12)))
    sched.add(Sequence("b", list(range(50, 57)), SamplingParams(max_tokens=12)))
    while not sched.num_preemptions:
        step(sched)
    assert [s.request_id for s in sched.waiting] == ["b"]
    return swapped


def test_a_preempted_sequence_is_swapped_only_when_the_copy_beats_the_recompute():
    # b holds 3 cached blocks, 1 of them no longer in the 3-slot host tier
    assert swaps_when_preempted(FAST) == ["b"]  # 4 block copies of 1 us: swap
    assert swaps_when_preempted(SLOW) == []  # 4 s of copies against 12 us: recompute
    assert swaps_when_preempted(None) == ["b"]  # nothing measured: swap


def tiers_holding(prompt, host_slots=8):
    tiers = TierManager(HostTier(host_slots), None, BS)
    hashes = hash_full_blocks(prompt, BS)
    tokens = [prompt[i * BS:(i + 1) * BS] for i in range(len(hashes))]
    return tiers, hashes, tokens


def test_an_export_pins_the_host_tier_s_leading_blocks_until_it_finishes():
    tiers, hashes, tokens = tiers_holding(PROMPT)
    for h, t in zip(hashes[:2], tokens[:2], strict=True):  # the host tier holds blocks 0, 1
        tiers.host.allocate(h, t)
    assert tiers.start_export("x", hashes, tokens) == [0, 1]  # a contiguous run only
    assert tiers.host.index.num_pinned == 2 and tiers.counters.exported == 2
    tiers.check_integrity()
    assert tiers.start_export("y", hashes[1:], [[0, 0, 0, 0]]) == []  # other tokens: no hit
    tiers.finish_export("x")
    tiers.finish_export("y")
    assert tiers.host.index.num_pinned == 0
    tiers.check_integrity()


def test_imported_blocks_take_host_slots_after_the_evicted_ones_go_to_disk(tmp_path):
    tiers = TierManager(HostTier(2), DiskTier(tmp_path, "layout", 8), BS)
    hashes = hash_full_blocks(PROMPT, BS)
    tokens = [PROMPT[i * BS:(i + 1) * BS] for i in range(3)]
    tiers.host.allocate(hashes[0], tokens[0])  # slot 0: already here, only touched
    other = hash_full_blocks(list(range(900, 904)), BS)[0]
    tiers.host.allocate(other, [900, 901, 902, 903])  # slot 1: evicted for an import
    assert tiers.import_blocks("imp", hashes[:2], tokens[:2]) == 1
    assert tiers.host.index.num_pinned == 1
    tiers.check_integrity()
    plan = tiers.take(KVCacheManager(4, BS).pool)
    # the evicted block is written to disk before its slot takes the staged row 1
    assert plan == KVTransfers(to_disk=[DiskWrite(1, other, (900, 901, 902, 903))],
                               imports=[HostImport("imp", [1], [1])])
    assert tiers.host.lookup(hashes[1], tokens[1]).slot == 1
    assert tiers.host.index.num_pinned == 0 and tiers.counters.imported == 1
    tiers.check_integrity()


def test_a_step_that_loads_is_priced_by_its_cost_beyond_its_prompt_tokens():
    sched = make(rates=FAST)  # 1,000 tokens/s; 1 GB/s of copies; 1,000-byte blocks
    cached_then_evicted(sched)
    # a prefill step: 200 tokens in 0.1 s, the prefill rate's only measure for a half-life
    sched.apply_transfers(TransferReport(steps=[StepCost(200, 200, 0, HALF_LIFE_S)]))
    prefill = (1000.0 * PRIOR_S / 2 + 200) / (PRIOR_S / 2 + HALF_LIFE_S)
    assert sched.rates.current().prefill_tokens_per_s == pytest.approx(prefill)
    # a step that loaded 3 blocks (3,000 bytes) and computed 3 prompt tokens in 1 s: the
    # blocks cost what the step did beyond those tokens, far more than their copy
    sched.apply_transfers(TransferReport(steps=[StepCost(3, 5, 3, 1.0)]))
    loads = sched.rates.loads
    load_seconds = 1.0 - 3 / prefill
    keep = 0.5 ** (load_seconds / HALF_LIFE_S)  # the prior: 16 blocks' copy, 16 us
    assert loads.amount == pytest.approx(16_000 * keep + 3000)
    assert loads.seconds == pytest.approx(16e-6 * keep + load_seconds)
    assert sched.rates.current().load_bytes_per_s == pytest.approx(loads.rate)
    assert sched.rates.current().prefill_tokens_per_s == pytest.approx(prefill)  # unmoved
    # so a 3-block load (~0.27 s at that rate) now costs more than its 12 tokens (~55 ms)
    sched.add(Sequence("b", PROMPT + [5, 6], SamplingParams(max_tokens=1)))
    ran, transfers = step(sched)
    assert ran == [("b", 0, 15)] and transfers is None


def test_a_step_whose_loads_hid_under_its_compute_costs_them_their_copy_alone():
    live = LiveRates(TransferRates(1000.0, 1e6, 1000))  # a block copies in 1 ms
    live.observe_step_cost(StepCost(1000, 1000, 2, 0.5))  # 1 s of prompt tokens in 0.5 s
    keep = 0.5 ** (0.002 / HALF_LIFE_S)  # the prior: 16 blocks' copy, 16 ms
    assert live.loads.amount == pytest.approx(16_000 * keep + 2000)
    assert live.loads.seconds == pytest.approx(0.016 * keep + 0.002)
    assert live.current().load_bytes_per_s == pytest.approx(1e6)
    # a step that loaded a whole prompt but its last token: all its time is the loads'
    live.observe_step_cost(StepCost(0, 1, 2, 0.5))
    assert live.loads.amount == pytest.approx(
        (16_000 * keep + 2000) * 0.5 ** (0.5 / HALF_LIFE_S) + 2000)


def test_of_the_loads_priced_out_every_sixteenth_is_started_to_measure_them_again():
    sched = make(num_blocks=40, rates=FAST)
    cached_then_evicted(sched)
    sched.rates = sched.loads.rates = LiveRates(SLOW)  # loads (and writes) priced out now
    for index in range(PROBE_EVERY):
        request_id = f"b{index}"
        sched.add(Sequence(request_id, PROMPT + [5, 6], SamplingParams(max_tokens=1)))
        ran, transfers = step(sched)
        if index < PROBE_EVERY - 1:
            assert ran == [(request_id, 0, 15)] and transfers is None  # recomputed
        else:
            assert ran == [(request_id, 12, 3)]
            assert [(load.request_id, load.host_slots) for load in transfers.loads] == [
                (request_id, [0, 1, 2])]
        sched.kv.reset_prefix_cache()  # the next one finds the host tier's blocks alone
    assert sched.loads.num_priced_out == PROBE_EVERY
