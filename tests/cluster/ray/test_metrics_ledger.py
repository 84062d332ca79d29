"""A replica's figures across its engines and processes: counts add up, gauges are the live
engine's, and nothing shown is taken back. Plain data, no Ray."""

from dataclasses import fields, replace

from cluster.engine.metrics import (
    COUNTER_FIELDS,
    GAUGE_FIELDS,
    HISTOGRAM_FIELDS,
    EngineMetrics,
    MetricsSnapshot,
    cumulative,
    empty_snapshot,
)
from cluster.ray.heartbeat import Heartbeat
from cluster.ray.metrics_ledger import MetricsLedger


def snapshot(tokens: int, running: int, ttft: float | None = None) -> MetricsSnapshot:
    metrics = EngineMetrics()
    if ttft is not None:
        metrics.on_first_token(3, ttft, 0.0)
    return replace(empty_snapshot(), time_to_first_token=metrics.time_to_first_token,
                   generation_tokens=tokens, finished_requests={"stop": tokens // 10},
                   spec_decode_accepted_per_position=(tokens,), num_running=running,
                   kv_blocks_total=64)


def test_every_snapshot_field_is_a_counter_a_histogram_or_a_gauge():
    names = [f.name for f in fields(MetricsSnapshot)]
    assert sorted(names) == sorted([*COUNTER_FIELDS, *HISTOGRAM_FIELDS, *GAUGE_FIELDS])


def test_counts_add_up_and_gauges_are_the_later_snapshot_s():
    total = cumulative(snapshot(20, 3, ttft=0.03), snapshot(5, 1, ttft=0.2))
    assert (total.generation_tokens, total.finished_requests, total.num_running) == (
        25, {"stop": 2}, 1)
    assert total.spec_decode_accepted_per_position == (25,)
    assert total.time_to_first_token.count == 2 and total.kv_blocks_total == 64


def test_request_histograms_add_up_and_the_cache_config_is_the_live_engine_s():
    def served(prompt_tokens: int, blocks: int) -> MetricsSnapshot:
        metrics = EngineMetrics()
        metrics.on_request_done(prompt_tokens, 2, prefill_time=0.01, decode_time=0.2)
        return replace(empty_snapshot(), request_prompt_tokens=metrics.request_prompt_tokens,
                       request_decode_time=metrics.request_decode_time,
                       cache_config={"num_gpu_blocks": str(blocks)})

    total = cumulative(served(12, 64), served(5, 32))  # a rebuild with a smaller cache
    assert (total.request_prompt_tokens.count, total.request_prompt_tokens.total) == (2, 17)
    assert total.request_decode_time.count == 2
    assert total.cache_config == {"num_gpu_blocks": "32"}
    # a replica that does not answer runs nothing we can see: no cache config, counts kept
    ledger = MetricsLedger(1)
    ledger.record(0, Heartbeat("a", 0, served(12, 64)))
    [unreachable] = ledger.totals([False])
    assert unreachable.cache_config == {} and unreachable.request_prompt_tokens.count == 1


def test_the_ledger_keeps_a_dead_process_s_counts_and_ignores_late_answers():
    ledger = MetricsLedger(2)
    ledger.record(0, Heartbeat("a", 0, snapshot(10, 2)))
    ledger.record(0, Heartbeat("a", 2, snapshot(30, 2)))
    ledger.record(0, Heartbeat("a", 1, snapshot(20, 2)))  # an older snapshot, arriving late
    assert [s.generation_tokens for s in ledger.totals([True, True])] == [30, 0]
    # Ray restarted replica 0: its new process counts from zero
    ledger.record(0, Heartbeat("b", 0, snapshot(4, 1)))
    ledger.record(0, Heartbeat("a", 3, snapshot(40, 2)))  # the dead one's: changes nothing
    [replica0, _] = ledger.totals([True, True])
    assert (replica0.generation_tokens, replica0.num_running) == (34, 1)
    # unreachable: its counts stay, its gauges say it runs nothing
    [replica0, _] = ledger.totals([False, True])
    assert (replica0.generation_tokens, replica0.num_running) == (34, 0)
