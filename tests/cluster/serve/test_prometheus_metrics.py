"""/metrics' names and bucket bounds, exactly, as Prometheus parses them: GPU-sized latency
buckets, the batch-size and per-request tokens/s histograms, and GPU gauges per replica and
rank (present from a device, absent on the CPU)."""

from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.metrics import EngineMetrics, MetricsSnapshot
from cluster.serve.prometheus import make_registry, render
from router.placement import ReplicaLoad
from router.replica_router import RouterStats
from workers.device_stats import DeviceStats

GIB = 1 << 30


def snapshot(engine: EngineMetrics, replica: int, devices=(),
             cache_config: dict | None = None) -> MetricsSnapshot:
    return MetricsSnapshot(
        engine.time_to_first_token, engine.inter_token_latency, engine.e2e_latency,
        engine.queue_time, prompt_tokens=0, generation_tokens=0, finished_requests={},
        preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, num_running=0,
        num_waiting=0, batch_size=engine.batch_size, kv_blocks_used=0, kv_blocks_total=8,
        batch_sizes=engine.batch_sizes, request_tokens_per_second=engine.request_tokens_per_second,
        devices=tuple(devices), replica=replica,
        request_prompt_tokens=engine.request_prompt_tokens,
        request_generation_tokens=engine.request_generation_tokens,
        request_prefill_time=engine.request_prefill_time,
        request_decode_time=engine.request_decode_time, cache_config=cache_config or {})


def scrape(snapshots, router=None) -> dict:
    text = render(make_registry("m", lambda: snapshots, router and (lambda: router))).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def bounds(family, replica="0") -> list[str]:
    return [s.labels["le"] for s in family.samples
            if s.name.endswith("_bucket") and s.labels["replica"] == replica]


def test_latency_buckets_start_at_half_a_millisecond():
    families = scrape([snapshot(EngineMetrics(), 0)])
    assert bounds(families["tandem:inter_token_latency_seconds"]) == [
        "0.0005", "0.001", "0.0015", "0.002", "0.003", "0.004", "0.005", "0.0075", "0.01",
        "0.015", "0.02", "0.025", "0.03", "0.04", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3",
        "0.5", "0.75", "1.0", "2.5", "5.0", "10.0", "20.0", "40.0", "80.0", "+Inf"]
    assert bounds(families["tandem:request_queue_time_seconds"]) == [
        "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5",
        "1.0", "2.5", "5.0", "10.0", "20.0", "30.0", "60.0", "120.0", "240.0", "480.0",
        "960.0", "1920.0", "7680.0", "+Inf"]
    assert bounds(families["tandem:time_to_first_token_seconds"])[:3] == ["0.001", "0.005",
                                                                           "0.01"]


def test_the_batch_size_and_tokens_per_second_histograms_count_steps_and_requests():
    engine = EngineMetrics()
    for num_seqs in (1, 3, 3, 64, 0):  # the 0: a step that only released sequences
        engine.on_step(num_seqs)
    engine.on_finish("length", 2.0, num_generated=100)  # 50 tokens/s
    engine.on_finish("stop", 0.5, num_generated=1000)  # 2000 tokens/s
    engine.on_finish("abort", 1.0)  # no tokens/s for an aborted request
    families = scrape([snapshot(engine, 0)])
    batch = families["tandem:step_batch_size"]
    assert batch.type == "histogram"
    assert bounds(batch) == ["1.0", "2.0", "4.0", "8.0", "12.0", "16.0", "24.0", "32.0", "48.0",
                             "64.0", "96.0", "128.0", "192.0", "256.0", "384.0", "512.0",
                             "768.0", "1024.0", "+Inf"]
    cumulative = {s.labels["le"]: s.value for s in batch.samples if s.name.endswith("_bucket")}
    assert (cumulative["1.0"], cumulative["2.0"], cumulative["4.0"], cumulative["48.0"],
            cumulative["64.0"]) == (1, 1, 3, 3, 4)
    sums = {s.name: s.value for s in batch.samples if not s.name.endswith("_bucket")}
    assert sums == {"tandem:step_batch_size_count": 4, "tandem:step_batch_size_sum": 71}
    assert [s.value for s in families["tandem:batch_size"].samples] == [0]  # the last step

    speed = families["tandem:request_generation_tokens_per_second"]
    assert bounds(speed) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "150.0",
                             "200.0", "300.0", "500.0", "750.0", "1000.0", "1500.0", "2000.0",
                             "3000.0", "5000.0", "10000.0", "+Inf"]
    cumulative = {s.labels["le"]: s.value for s in speed.samples if s.name.endswith("_bucket")}
    assert (cumulative["20.0"], cumulative["50.0"], cumulative["1500.0"],
            cumulative["2000.0"]) == (0, 1, 1, 2)


def test_gpu_gauges_per_replica_and_rank_and_none_on_the_cpu():
    gpu = [DeviceStats(0, 0.75, 70 * GIB, 140 * GIB, 60 * GIB),
           DeviceStats(1, None, 71 * GIB, 140 * GIB, 61 * GIB)]  # rank 1 without NVML
    # replica 3: indices of removed replicas are not reused, so labels follow the snapshot's
    families = scrape([snapshot(EngineMetrics(), 3, gpu), snapshot(EngineMetrics(), 5)])

    def values(name):
        return {(s.labels["replica"], s.labels["rank"]): s.value for s in families[name].samples}

    assert values("tandem:gpu_utilization") == {("3", "0"): 0.75}
    assert values("tandem:gpu_memory_used_bytes") == {("3", "0"): 70 * GIB, ("3", "1"): 71 * GIB}
    assert values("tandem:gpu_memory_total_bytes") == {("3", "0"): 140 * GIB,
                                                       ("3", "1"): 140 * GIB}
    assert values("tandem:gpu_memory_reserved_bytes") == {("3", "0"): 60 * GIB,
                                                          ("3", "1"): 61 * GIB}
    assert {s.labels["replica"] for s in families["tandem:num_requests_running"].samples} == {
        "3", "5"}
    # a CPU-only cluster: the families are declared, with no sample (not a zero that would
    # read as an idle GPU)
    cpu = scrape([snapshot(EngineMetrics(), 0)])
    for name in ("tandem:gpu_utilization", "tandem:gpu_memory_used_bytes",
                 "tandem:gpu_memory_total_bytes", "tandem:gpu_memory_reserved_bytes"):
        assert cpu[name].type == "gauge" and cpu[name].samples == []


def test_removed_replicas_leave_the_routers_per_replica_gauges():
    router = RouterStats({}, directory_blocks=0, event_lag_s=None,
                         loads=[ReplicaLoad(num_requests=1), ReplicaLoad(accepting=False),
                                ReplicaLoad()], resyncs=0, blocks_held=[3, 0, 2],
                         removed=frozenset({1}), host_blocks_held=[5, 0, 4])
    families = scrape([snapshot(EngineMetrics(), 0)], router)
    in_flight = families["tandem:router_requests_in_flight"].samples
    assert {s.labels["replica"]: s.value for s in in_flight} == {"0": 1, "2": 0}
    held = families["tandem:kv_directory_replica_blocks"].samples
    assert {s.labels["replica"]: s.value for s in held} == {"0": 3, "2": 2}
    in_host = families["tandem:kv_directory_replica_host_blocks"].samples
    assert {s.labels["replica"]: s.value for s in in_host} == {"0": 5, "2": 4}


def test_vllm_s_request_histograms_per_finished_request():
    engine = EngineMetrics()
    engine.on_request_done(12, 3, prefill_time=0.004, decode_time=0.35)
    engine.on_request_done(300, 1, prefill_time=0.02, decode_time=0.0)  # its first token ended it
    engine.on_request_done(7, 0, prefill_time=None, decode_time=None)  # never had a first token
    families = scrape([snapshot(engine, 0)])
    tokens = ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0",
              "2000.0", "5000.0", "10000.0", "20000.0", "50000.0", "100000.0", "200000.0",
              "500000.0", "1000000.0", "+Inf"]
    phases = ["0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.2",
              "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0",
              "30.0", "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0",
              "7680.0", "+Inf"]

    def summary(name):
        family = families[name]
        assert family.type == "histogram"
        buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
        rest = {s.name.removeprefix(name): s.value for s in family.samples
                if not s.name.endswith("_bucket")}
        return bounds(family), buckets, rest

    names, buckets, rest = summary("tandem:request_prompt_tokens")
    assert names == tokens
    assert (buckets["5.0"], buckets["10.0"], buckets["20.0"], buckets["500.0"]) == (0, 1, 2, 3)
    assert rest == {"_count": 3, "_sum": 319}
    names, buckets, rest = summary("tandem:request_generation_tokens")
    assert names == tokens and rest == {"_count": 3, "_sum": 4}
    assert (buckets["1.0"], buckets["2.0"], buckets["5.0"]) == (2, 2, 3)
    names, buckets, rest = summary("tandem:request_prefill_time_seconds")
    assert names == phases and rest == {"_count": 2, "_sum": 0.024}
    assert (buckets["0.0025"], buckets["0.005"], buckets["0.025"]) == (0, 1, 2)
    names, buckets, rest = summary("tandem:request_decode_time_seconds")
    assert names == phases and rest == {"_count": 2, "_sum": 0.35}
    assert (buckets["0.0005"], buckets["0.3"], buckets["0.5"]) == (1, 1, 2)


def test_cache_config_info_is_a_gauge_of_one_with_the_config_in_its_labels():
    config = {"block_size": "16", "cache_dtype": "int8", "enable_prefix_caching": "True",
              "gpu_memory_utilization": "0.9", "num_gpu_blocks": "4096",
              "num_cpu_blocks": "None"}
    # replica 1 runs no engine now (rebuilding): no sample for it
    families = scrape([snapshot(EngineMetrics(), 0, cache_config=config),
                       snapshot(EngineMetrics(), 1)])
    info = families["tandem:cache_config_info"]
    assert info.type == "gauge"
    assert [(s.labels, s.value) for s in info.samples] == [
        ({"model_name": "m", "replica": "0", **config}, 1.0)]
