"""Prometheus metrics gathered from every replica at scrape time, named like vLLM's.

The collector holds no numbers: each scrape asks the replicas for their ``MetricsSnapshot``
and labels every sample with ``model_name`` and ``replica``. It lives in a registry of its
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

from cluster.engine.metrics import Histogram, MetricsSnapshot

PREFIX = "tandem:"
LABELS = ["model_name", "replica"]

HISTOGRAMS = {  # name -> (snapshot field, help)
    "time_to_first_token_seconds": ("time_to_first_token", "Time to first token in seconds."),
    "inter_token_latency_seconds": ("inter_token_latency", "Time between tokens in seconds."),
    "e2e_request_latency_seconds": ("e2e_latency", "End-to-end request latency in seconds."),
    "request_queue_time_seconds": ("queue_time", "Time from arrival to first scheduling."),
}
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens processed."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("preemptions", "Sequences preempted."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix "
                             "cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "spec_decode_num_drafts": ("spec_decode_drafts", "Speculative drafting steps."),
    "spec_decode_num_draft_tokens": ("spec_decode_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("spec_decode_accepted_tokens", "Draft tokens accepted."),
}
GAUGES = {
    "num_requests_running": ("num_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
    "batch_size": ("batch_size", "Sequences in the last engine step."),
    "kv_cache_blocks_used": ("kv_blocks_used", "KV cache blocks in use."),
    "kv_cache_blocks_total": ("kv_blocks_total", "KV cache blocks in all."),
}
# every name /metrics exposes (counters with their _total suffix), for docs and tests
METRIC_NAMES = (
    [PREFIX + name for name in HISTOGRAMS]
    + [PREFIX + name + "_total" for name in [*COUNTERS, "request_success"]]
    + [PREFIX + name for name in [*GAUGES, "kv_cache_usage_perc"]]
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
    def __init__(self, model_name: str,
                 fetch: Callable[[], Sequence[MetricsSnapshot]]) -> None:
        self.model_name = model_name
        self.fetch = fetch

    def describe(self) -> list[Metric]:
        return []  # registering must not call the replicas

    def collect(self) -> Iterator[Metric]:
        snapshots = list(enumerate(self.fetch()))
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
        yield self._success(labels, [snap for _, snap in snapshots])
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

    def _success(self, labels: list[list[str]], snaps: list[MetricsSnapshot]) -> Metric:
        family = CounterMetricFamily(PREFIX + "request_success", "Finished requests by reason.",
                                     labels=[*LABELS, "finished_reason"])
        for label, snap in zip(labels, snaps, strict=True):
            for reason in sorted({"stop", "length", "abort", *snap.finished_requests}):
                family.add_metric([*label, reason], snap.finished_requests.get(reason, 0))
        return family


def make_registry(model_name: str,
                  fetch: Callable[[], Sequence[MetricsSnapshot]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaCollector(model_name, fetch))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
