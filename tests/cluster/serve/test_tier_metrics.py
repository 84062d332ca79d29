"""/metrics labels prefix-cache hits by the tier that held them and counts the KV bytes moved
between tiers, from each replica's snapshot."""

from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.metrics import EngineMetrics, MetricsSnapshot
from cluster.serve.prometheus import make_registry, render


def snapshot(hits, host, disk, offloaded, loaded, load_seconds):
    engine = EngineMetrics()
    for seconds in load_seconds:
        engine.kv_load_latency.observe(seconds)
    return MetricsSnapshot(
        engine.time_to_first_token, engine.inter_token_latency, engine.e2e_latency,
        engine.queue_time, prompt_tokens=0, generation_tokens=0, finished_requests={},
        preemptions=0, prefix_cache_queries=100, prefix_cache_hits=hits, num_running=0,
        num_waiting=0, batch_size=0, kv_blocks_used=0, kv_blocks_total=8,
        host_cache_hits=host, disk_cache_hits=disk, kv_offloaded_bytes=offloaded,
        kv_loaded_bytes=loaded, kv_load_latency=engine.kv_load_latency)


def test_hits_are_labelled_by_tier_and_bytes_moved_by_tier():
    snapshots = [snapshot(60, 32, 16, {"host": 4096, "disk": 2048}, {"host": 8192, "disk": 0},
                          [0.002, 0.2]),
                 snapshot(8, 0, 0, {}, {}, [])]  # a replica without tiers
    text = render(make_registry("m", lambda: snapshots)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def by(name, suffix="_total"):
        return {(s.labels["replica"], s.labels["tier"]): s.value
                for s in families[name].samples if s.name == name + suffix}

    assert by("tandem:prefix_cache_hits") == {
        ("0", "gpu"): 12.0, ("0", "host"): 32.0, ("0", "disk"): 16.0,
        ("1", "gpu"): 8.0, ("1", "host"): 0.0, ("1", "disk"): 0.0}
    assert by("tandem:kv_offload_bytes") == {("0", "host"): 4096.0, ("0", "disk"): 2048.0,
                                             ("1", "host"): 0.0, ("1", "disk"): 0.0}
    assert by("tandem:kv_load_bytes") == {("0", "host"): 8192.0, ("0", "disk"): 0.0,
                                          ("1", "host"): 0.0, ("1", "disk"): 0.0}
    latency = {(s.labels["replica"], s.labels.get("le")): s.value
               for s in families["tandem:kv_load_latency_seconds"].samples
               if s.name.endswith("_bucket")}
    assert (latency[("0", "0.0025")], latency[("0", "0.25")], latency[("0", "+Inf")]) == (
        1.0, 2.0, 2.0)
    # the hit rate still counts every tier's hits
    rates = {s.labels["replica"]: s.value for s in families["tandem:prefix_cache_hit_rate"].samples}
    assert rates == {"0": 0.6, "1": 0.08}
