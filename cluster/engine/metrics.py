"""What one engine counts for Prometheus: plain numbers, no registry and no globals.

The engine records into ``EngineMetrics``; ``snapshot()`` copies it into a picklable
``MetricsSnapshot`` that the HTTP ingress gathers from every replica at scrape time.

Bucket bounds follow vLLM's where they fit a GPU: a decode step takes about a millisecond
there, so inter-token latency and queue time start at 0.5 ms (vLLM's start at 10 ms and
0.3 s, where every step of a small model would land in the first bucket and no p50 or p99
could be read).
"""

import bisect
from dataclasses import dataclass, field

from workers.device_stats import DeviceStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02,
               0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 40.0, 80.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# sequences in one engine step: powers of two and the halfway points, to the largest batches
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0,
                      256.0, 384.0, 512.0, 768.0, 1024.0)
# a request's generated tokens over its end-to-end time: from a long queue (1) to a GPU's
# decode speed for one sequence (a few thousand)
TOKENS_PER_SECOND_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 150.0, 200.0, 300.0, 500.0,
                             750.0, 1000.0, 1500.0, 2000.0, 3000.0, 5000.0, 10000.0)
# loads of a prefix from the host tier or disk: a few blocks over PCIe, up to many from disk
KV_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# a request's prefill (first scheduled to first token) and decode (first token to finish):
# vLLM's request-latency buckets, with bounds below their 0.3 s as queue time has them (on a
# GPU a prefill, or a short decode, takes milliseconds)
REQUEST_PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2,
                         *LATENCY_BUCKETS)
# a request's prompt or generated tokens: vLLM's 1, 2, 5, 10, 20, 50, ... series, to a million
# here (vLLM's stops at the model's context, so its top buckets differ by model; these are the
# same for every replica and engine, and those past the context stay empty)
REQUEST_TOKENS_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5)
                               if m * 10**e <= 10**6)
# the engine's KV cache configuration, as vLLM's cache_config_info labels name it
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching",
                       "gpu_memory_utilization", "num_gpu_blocks", "num_cpu_blocks")


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times

    def copy(self) -> "Histogram":
        return Histogram(self.bounds, list(self.counts), self.total, self.count)


@dataclass
class MetricsSnapshot:
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram
    queue_time: Histogram
    prompt_tokens: int
    generation_tokens: int
    finished_requests: dict[str, int]  # finish reason -> count
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    batch_size: int  # sequences in the last step
    kv_blocks_used: int
    kv_blocks_total: int
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()  # kept drafts by their place
    spec_decode_speedup: float = 1.0  # EngineMetrics.spec_decode_speedup
    batch_sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))
    request_tokens_per_second: Histogram = field(
        default_factory=lambda: Histogram(TOKENS_PER_SECOND_BUCKETS))
    devices: tuple[DeviceStats, ...] = ()  # one per shard on a GPU, none on the CPU
    replica: int | None = None  # the cluster's replica index; None outside a cluster

    host_cache_hits: int = 0  # of prefix_cache_hits, found in the host tier
    disk_cache_hits: int = 0  # and on disk
    kv_offloaded_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes into it
    kv_loaded_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes out of it
    kv_load_latency: Histogram = field(default_factory=lambda: Histogram(KV_LOAD_BUCKETS))
    request_prompt_tokens: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_TOKENS_BUCKETS))
    request_generation_tokens: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_TOKENS_BUCKETS))
    request_prefill_time: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_PHASE_BUCKETS))
    request_decode_time: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_PHASE_BUCKETS))
    # CACHE_CONFIG_LABELS -> value, as vLLM writes them (str()); empty where no engine runs
    cache_config: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadSample:
    """What the autoscaler reads from a replica each second: small, no histogram copies but
    the time-to-first-token counts its window needs."""

    waiting_prompt_tokens: int  # prompt tokens queued and not computed yet
    running_seqs: int
    kv_usage: float  # 0 to 1
    ttft_counts: tuple[int, ...]  # per TTFT_BUCKETS bucket (+Inf last), since the engine began


@dataclass
class EngineMetrics:
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))
    batch_sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))
    request_tokens_per_second: Histogram = field(
        default_factory=lambda: Histogram(TOKENS_PER_SECOND_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: dict[str, int] = field(default_factory=dict)
    batch_size: int = 0
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    spec_decode_accepted_per_position: list[int] = field(default_factory=list)
    spec_decode_verify_seconds: float = 0.0  # the steps that verified drafts
    spec_decode_plain_seconds: float = 0.0  # plain steps' estimated time for the same tokens
    # from a load's start (host tier or disk to the device) to the workers' report of it
    kv_load_latency: Histogram = field(default_factory=lambda: Histogram(KV_LOAD_BUCKETS))
    # per finished request (aborted ones left out), as vLLM's request_* histograms
    request_prompt_tokens: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_TOKENS_BUCKETS))
    request_generation_tokens: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_TOKENS_BUCKETS))
    request_prefill_time: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_PHASE_BUCKETS))
    request_decode_time: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_PHASE_BUCKETS))

    @property
    def spec_decode_speedup(self) -> float:
        """Measured: > 1 when speculation made tokens faster than plain steps would have."""
        if not self.spec_decode_verify_seconds:
            return 1.0
        return self.spec_decode_plain_seconds / self.spec_decode_verify_seconds

    def on_first_token(self, num_prompt_tokens: int, ttft: float, queue_time: float) -> None:
        self.prompt_tokens += num_prompt_tokens
        self.time_to_first_token.observe(ttft)
        self.queue_time.observe(queue_time)

    def on_step(self, num_seqs: int) -> None:
        self.batch_size = num_seqs
        if num_seqs:  # a step that only released finished sequences ran no batch
            self.batch_sizes.observe(num_seqs)

    def on_finish(self, reason: str, e2e_latency: float, num_generated: int = 0) -> None:
        """``num_generated``: the request's output tokens (all of its completions), for its
        tokens per second; aborted requests pass none and are left out of that histogram."""
        self.finished_requests[reason] = self.finished_requests.get(reason, 0) + 1
        self.e2e_latency.observe(e2e_latency)
        if num_generated and e2e_latency > 0:
            self.request_tokens_per_second.observe(num_generated / e2e_latency)

    def on_request_done(self, num_prompt_tokens: int, num_generated: int,
                        prefill_time: float | None, decode_time: float | None) -> None:
        """A request that finished (not aborted): its sizes, and the time of its two phases
        (None for a request that never had a first token)."""
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated)
        if prefill_time is not None and decode_time is not None:
            self.request_prefill_time.observe(prefill_time)
            self.request_decode_time.observe(decode_time)


# MetricsSnapshot fields by how two snapshots of one replica add up: counters and histograms
# are summed (what an engine that was replaced had counted stays counted), gauges are the
# newer snapshot's (what runs now). Every field is in exactly one of these.
COUNTER_FIELDS = ("prompt_tokens", "generation_tokens", "finished_requests", "preemptions",
                  "prefix_cache_queries", "prefix_cache_hits", "spec_decode_drafts",
                  "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
                  "spec_decode_accepted_per_position", "host_cache_hits", "disk_cache_hits",
                  "kv_offloaded_bytes", "kv_loaded_bytes")
HISTOGRAM_FIELDS = ("time_to_first_token", "inter_token_latency", "e2e_latency", "queue_time",
                    "batch_sizes", "request_tokens_per_second", "kv_load_latency",
                    "request_prompt_tokens", "request_generation_tokens",
                    "request_prefill_time", "request_decode_time")
GAUGE_FIELDS = ("num_running", "num_waiting", "batch_size", "kv_blocks_used",
                "kv_blocks_total", "spec_decode_speedup", "devices", "replica", "cache_config")


def cache_config_info(block_size: int, cache_dtype: str, enable_prefix_caching: bool,
                      gpu_memory_utilization: float, num_gpu_blocks: int,
                      num_cpu_blocks: int | None) -> dict[str, str]:
    """vLLM's cache_config_info labels: ``num_gpu_blocks`` the device's KV blocks (on the CPU
    too), ``num_cpu_blocks`` the host tier's (None without one)."""
    values = (block_size, cache_dtype, enable_prefix_caching, gpu_memory_utilization,
              num_gpu_blocks, num_cpu_blocks)
    return dict(zip(CACHE_CONFIG_LABELS, map(str, values), strict=True))


def empty_snapshot() -> MetricsSnapshot:
    """What an engine that has done nothing reports: zero counts, empty histograms."""
    metrics = EngineMetrics()
    return MetricsSnapshot(
        metrics.time_to_first_token, metrics.inter_token_latency, metrics.e2e_latency,
        metrics.queue_time, prompt_tokens=0, generation_tokens=0, finished_requests={},
        preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, num_running=0,
        num_waiting=0, batch_size=0, kv_blocks_used=0, kv_blocks_total=0)


def cumulative(earlier: MetricsSnapshot, later: MetricsSnapshot) -> MetricsSnapshot:
    """``earlier``'s counters and histograms added to ``later``'s, with ``later``'s gauges:
    one replica's figures across the engines (or processes) it has had, so a rebuild never
    makes a counter go backwards."""
    values: dict[str, object] = {name: getattr(later, name) for name in GAUGE_FIELDS}
    for name in HISTOGRAM_FIELDS:
        a, b = getattr(earlier, name), getattr(later, name)
        values[name] = Histogram(b.bounds, [x + y for x, y in zip(a.counts, b.counts,
                                                                   strict=True)],
                                 a.total + b.total, a.count + b.count)
    for name in COUNTER_FIELDS:
        a, b = getattr(earlier, name), getattr(later, name)
        if isinstance(a, dict):
            values[name] = {key: a.get(key, 0) + b.get(key, 0) for key in {*a, *b}}
        elif isinstance(a, tuple):
            longest = max(len(a), len(b))
            values[name] = tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)
                                 for i in range(longest))
        else:
            values[name] = a + b
    return MetricsSnapshot(**values)  # type: ignore[arg-type]


def idle(snapshot: MetricsSnapshot) -> MetricsSnapshot:
    """The snapshot with its gauges at rest: what a replica without an engine runs (nothing),
    its counts kept."""
    return cumulative(snapshot, empty_snapshot())
