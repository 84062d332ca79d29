"""Prometheus metrics gathered from every replica and the router at scrape time, named like
vLLM's.

The collectors hold no numbers: each scrape asks the replicas for their ``MetricsSnapshot`` and
the router for its ``RouterStats``, and labels every sample with ``model_name`` (and
``replica`` where it is one replica's). It lives in a registry of its
own, so two servers in one process never share metrics.
"""

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cluster.engine.metrics import CACHE_CONFIG_LABELS, Histogram, MetricsSnapshot
from router.placement import REASONS
from router.replica_router import RouterStats

PREFIX = "tandem:"
LABELS = ["model_name", "replica"]

HISTOGRAMS = {  # name -> (snapshot field, help)
    "time_to_first_token_seconds": ("time_to_first_token", "Time to first token in seconds."),
    "inter_token_latency_seconds": ("inter_token_latency", "Time between tokens in seconds."),
    "e2e_request_latency_seconds": ("e2e_latency", "End-to-end request latency in seconds."),
    "request_queue_time_seconds": ("queue_time", "Time from arrival to first scheduling."),
    "step_batch_size": ("batch_sizes", "Sequences in each engine step."),
    "request_generation_tokens_per_second": ("request_tokens_per_second", "A finished "
                                             "request's generated tokens over its end-to-end "
                                             "time (aborted requests left out)."),
    "kv_load_latency_seconds": ("kv_load_latency", "Loads of a prefix from the host or disk "
                                "KV tier: from their start to their blocks on the device."),
    # vLLM's request histograms, per finished request (aborted ones left out)
    "request_prompt_tokens": ("request_prompt_tokens", "Prompt tokens of each finished "
                              "request."),
    "request_generation_tokens": ("request_generation_tokens", "Tokens generated for each "
                                  "finished request (all of its n completions)."),
    "request_prefill_time_seconds": ("request_prefill_time", "A finished request's prefill: "
                                     "from its first scheduling to its first token."),
    "request_decode_time_seconds": ("request_decode_time", "A finished request's decode: "
                                    "from its first token to its last."),
}
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens processed."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("preemptions", "Sequences preempted."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix "
                             "cache."),
    "spec_decode_num_drafts": ("spec_decode_drafts", "Speculative drafting steps."),
    "spec_decode_num_draft_tokens": ("spec_decode_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("spec_decode_accepted_tokens", "Draft tokens accepted."),
}
TIERS = ("gpu", "host", "disk")  # where a prefix-cache hit was found
TIER_COUNTERS = {  # name -> (snapshot field: tier -> bytes, help), labelled by tier
    "kv_offload_bytes": ("kv_offloaded_bytes", "KV bytes copied into a tier: host (from the "
                         "device), disk (from the host)."),
    "kv_load_bytes": ("kv_loaded_bytes", "KV bytes copied out of a tier: host (to the "
                      "device), disk (to the host)."),
}
GAUGES = {
    "num_requests_running": ("num_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
    "batch_size": ("batch_size", "Sequences in the last engine step."),
    "kv_cache_blocks_used": ("kv_blocks_used", "KV cache blocks in use."),
    "kv_cache_blocks_total": ("kv_blocks_total", "KV cache blocks in all."),
    "spec_decode_speedup": ("spec_decode_speedup", "Speculative decoding's measured speedup: "
                            "plain steps' estimated time for the tokens verify steps made, over "
                            "their time (1: none yet)."),
}
ROUTER_METRICS = {  # name -> help; the router's, from its RouterStats
    "router_decisions_total": "Requests routed, by reason: affinity (a cached prefix), no_match, "
    "load_guard (the cheapest replica had too many more in flight), least_loaded, round_robin.",
    "kv_directory_blocks": "Distinct KV block hashes the router's directory knows a replica "
    "holds.",
    "kv_directory_replica_blocks": "KV blocks the directory lists in each replica's device "
    "cache.",
    "kv_directory_replica_host_blocks": "KV blocks the directory lists in each replica's host "
    "tier (loaded there, or pulled from there by another replica).",
    "kv_directory_resyncs_total": "Times a gap in a replica's KV events made the router fetch "
    "its cache dump.",
    "kv_event_lag_seconds": "The last KV event batch: from its engine step's end to the router.",
    "router_requests_in_flight": "Requests the router placed on each replica, not finished.",
    "request_failovers_total": "Requests continued on another replica after theirs was lost "
    "(a shard or the replica's process died).",
    "requests_rejected_total": "Requests refused with a 503 before reaching a replica, by "
    "reason: overloaded (every queue full), draining (shutting down).",
}
GPU_LABELS = [*LABELS, "rank"]
GPU_GAUGES = {  # name -> (DeviceStats field, help); from each shard's device, none on the CPU
    "gpu_utilization": ("utilization", "Share of NVML's last sample period a kernel ran on the "
                        "shard's GPU, 0 to 1 (no sample without NVML)."),
    "gpu_memory_used_bytes": ("memory_used_bytes", "Memory used on the shard's GPU by every "
                              "process, as nvidia-smi shows it."),
    "gpu_memory_total_bytes": ("memory_total_bytes", "The shard's GPU's memory."),
    "gpu_memory_reserved_bytes": ("memory_reserved_bytes", "Memory the shard's PyTorch "
                                  "allocator holds: weights, KV cache, activations."),
}
CACHE_CONFIG_INFO = "cache_config_info"  # vLLM's: a gauge of 1, the config in its labels
REJECTION_REASONS = ("overloaded", "draining")
# every name /metrics exposes (counters with their _total suffix), for docs and tests
METRIC_NAMES = (
    [PREFIX + name for name in HISTOGRAMS]
    + [PREFIX + name + "_total" for name in [*COUNTERS, "request_success", "prefix_cache_hits",
                                             *TIER_COUNTERS]]
    + [PREFIX + name for name in [*GAUGES, "kv_cache_usage_perc", "prefix_cache_hit_rate",
                                  CACHE_CONFIG_INFO]]
    + [PREFIX + name for name in ROUTER_METRICS]
    # on the CPU these families have no samples: /metrics shows their names only
    + [PREFIX + name for name in GPU_GAUGES]
    # by position: no sample until a draft is accepted, so the family's name (no _total)
    + [PREFIX + "spec_decode_num_accepted_tokens_per_pos"]
)


def histogram_buckets(histogram: Histogram) -> list[tuple[str, float]]:
    """Prometheus buckets are cumulative and end with +Inf."""
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip([*map(str, histogram.bounds), "+Inf"], histogram.counts, strict=True):
        total += count
        buckets.append((bound, total))
    return buckets


class ReplicaCollector(Collector):
    @staticmethod
    def _accepted_per_position(labels: list[list[str]],
                               snapshots: list[MetricsSnapshot]) -> Metric:
        counter = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
            "their position among a step's drafts (0: the first).", labels=[*LABELS, "position"])
        for label, snap in zip(labels, snapshots, strict=True):
            for position, count in enumerate(snap.spec_decode_accepted_per_position):
                counter.add_metric([*label, str(position)], count)
        return counter

    def __init__(self, model_name: str,
                 fetch: Callable[[], Sequence[MetricsSnapshot]]) -> None:
        self.model_name = model_name
        self.fetch = fetch

    def describe(self) -> list[Metric]:
        return []  # registering must not call the replicas

    def collect(self) -> Iterator[Metric]:
        # a replica's own index where it has one: indices of removed replicas are never reused
        snapshots = [(position if snap.replica is None else snap.replica, snap)
                     for position, snap in enumerate(self.fetch())]
        labels = [[self.model_name, str(replica)] for replica, _ in snapshots]
        for name, (field, doc) in HISTOGRAMS.items():
            family = HistogramMetricFamily(PREFIX + name, doc, labels=LABELS)
            for label, (_, snap) in zip(labels, snapshots, strict=True):
                histogram: Histogram = getattr(snap, field)
                family.add_metric(label, histogram_buckets(histogram), histogram.total)
            yield family
        for name, (field, doc) in COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            for label, (_, snap) in zip(labels, snapshots, strict=True):
                counter.add_metric(label, getattr(snap, field))
            yield counter
        yield self._hits_by_tier(labels, [snap for _, snap in snapshots])
        for name, (field, doc) in TIER_COUNTERS.items():
            by_tier = CounterMetricFamily(PREFIX + name, doc, labels=[*LABELS, "tier"])
            for label, (_, snap) in zip(labels, snapshots, strict=True):
                moved: dict[str, int] = getattr(snap, field)
                for tier in ("host", "disk"):
                    by_tier.add_metric([*label, tier], moved.get(tier, 0))
            yield by_tier
        yield self._success(labels, [snap for _, snap in snapshots])
        yield self._accepted_per_position(labels, [snap for _, snap in snapshots])
        for name, (field, doc) in GAUGES.items():
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            for label, (_, snap) in zip(labels, snapshots, strict=True):
                gauge.add_metric(label, getattr(snap, field))
            yield gauge
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                  "Fraction of KV cache blocks in use (0 to 1).", labels=LABELS)
        for label, (_, snap) in zip(labels, snapshots, strict=True):
            usage.add_metric(label, snap.kv_blocks_used / max(snap.kv_blocks_total, 1))
        yield usage
        hit_rate = GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate", "Prompt tokens found in "
                                     "the prefix cache / looked up, since the engine started.",
                                     labels=LABELS)
        for label, (_, snap) in zip(labels, snapshots, strict=True):
            hit_rate.add_metric(label, snap.prefix_cache_hits / max(snap.prefix_cache_queries, 1))
        yield hit_rate
        yield self._cache_config(labels, [snap for _, snap in snapshots])
        yield from self._devices(labels, [snap for _, snap in snapshots])

    @staticmethod
    def _cache_config(labels: list[list[str]], snaps: list[MetricsSnapshot]) -> Metric:
        """Each replica's KV cache configuration in the labels of a gauge of 1, as vLLM's
        cache_config_info (none for a replica that runs no engine now)."""
        info = GaugeMetricFamily(PREFIX + CACHE_CONFIG_INFO, "Information of the engine's KV "
                                 "cache configuration.", labels=[*LABELS, *CACHE_CONFIG_LABELS])
        for label, snap in zip(labels, snaps, strict=True):
            if snap.cache_config:
                info.add_metric([*label, *(snap.cache_config[key]
                                           for key in CACHE_CONFIG_LABELS)], 1)
        return info

    @staticmethod
    def _devices(labels: list[list[str]], snaps: list[MetricsSnapshot]) -> Iterator[Metric]:
        for name, (field, doc) in GPU_GAUGES.items():
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=GPU_LABELS)
            for label, snap in zip(labels, snaps, strict=True):
                for device in snap.devices:
                    value = getattr(device, field)
                    if value is not None:
                        gauge.add_metric([*label, str(device.rank)], value)
            yield gauge

    @staticmethod
    def _hits_by_tier(labels: list[list[str]], snaps: list[MetricsSnapshot]) -> Metric:
        """Prompt tokens found cached, by where: the device's cache, the host tier, disk."""
        family = CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found in "
                                     "the prefix cache, by the tier that held them.",
                                     labels=[*LABELS, "tier"])
        for label, snap in zip(labels, snaps, strict=True):
            gpu = snap.prefix_cache_hits - snap.host_cache_hits - snap.disk_cache_hits
            for tier, hits in zip(TIERS, (gpu, snap.host_cache_hits, snap.disk_cache_hits),
                                  strict=True):
                family.add_metric([*label, tier], hits)
        return family

    def _success(self, labels: list[list[str]], snaps: list[MetricsSnapshot]) -> Metric:
        family = CounterMetricFamily(PREFIX + "request_success", "Finished requests by reason.",
                                     labels=[*LABELS, "finished_reason"])
        for label, snap in zip(labels, snaps, strict=True):
            for reason in sorted({"stop", "length", "abort", *snap.finished_requests}):
                family.add_metric([*label, reason], snap.finished_requests.get(reason, 0))
        return family


class RouterCollector(Collector):
    def __init__(self, model_name: str, fetch: Callable[[], RouterStats]) -> None:
        self.model_name = model_name
        self.fetch = fetch

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats, model, docs = self.fetch(), [self.model_name], ROUTER_METRICS
        decisions = CounterMetricFamily(PREFIX + "router_decisions", docs[
            "router_decisions_total"], labels=["model_name", "reason"])
        for reason in REASONS:
            decisions.add_metric([*model, reason], stats.decisions.get(reason, 0))
        yield decisions
        blocks = GaugeMetricFamily(PREFIX + "kv_directory_blocks", docs["kv_directory_blocks"],
                                   labels=["model_name"])
        blocks.add_metric(model, stats.directory_blocks)
        yield blocks
        resyncs = CounterMetricFamily(PREFIX + "kv_directory_resyncs",
                                      docs["kv_directory_resyncs_total"], labels=["model_name"])
        resyncs.add_metric(model, stats.resyncs)
        yield resyncs
        failovers = CounterMetricFamily(PREFIX + "request_failovers",
                                        docs["request_failovers_total"], labels=["model_name"])
        failovers.add_metric(model, stats.failovers)
        yield failovers
        rejected = CounterMetricFamily(PREFIX + "requests_rejected",
                                       docs["requests_rejected_total"],
                                       labels=["model_name", "reason"])
        for reason in REJECTION_REASONS:
            rejected.add_metric([*model, reason], stats.rejected.get(reason, 0))
        yield rejected
        lag = GaugeMetricFamily(PREFIX + "kv_event_lag_seconds", docs["kv_event_lag_seconds"],
                                labels=["model_name"])
        lag.add_metric(model, stats.event_lag_s if stats.event_lag_s is not None else 0.0)
        yield lag
        for name, values in (("kv_directory_replica_blocks", stats.blocks_held),
                             ("kv_directory_replica_host_blocks", stats.host_blocks_held),
                             ("router_requests_in_flight",
                              [load.num_requests for load in stats.loads])):
            family = GaugeMetricFamily(PREFIX + name, docs[name], labels=LABELS)
            for replica, value in enumerate(values):
                if replica not in stats.removed:  # the autoscaler took it away
                    family.add_metric([self.model_name, str(replica)], value)
            yield family


def make_registry(model_name: str, fetch: Callable[[], Sequence[MetricsSnapshot]],
                  fetch_router: Callable[[], RouterStats] | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaCollector(model_name, fetch))
    if fetch_router is not None:
        registry.register(RouterCollector(model_name, fetch_router))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
