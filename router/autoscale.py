"""How many engine replicas to run: a pure decision over each replica's load, sampled each second.

Ray Serve's autoscaling scales the HTTP ingress only; the engine replicas are tandem's own
actors, so ``cluster/ray/autoscaler.py`` samples them, calls ``decide`` and carries out its
answer (a new replica is a new placement group; a replica leaves after draining).

Load is measured against a target per signal, as Kubernetes' HPA does::

    ratio = max(mean waiting prompt tokens / target, mean running sequences / target,
                mean KV usage / target, worst TTFT p90 over the window / target)

    wants up:    ratio > 1 + tolerance                         (over target)
    wants down:  ratio * n / (n - 1) < 1 - tolerance           (n - 1 replicas stay under target)

Between the two lies the hysteresis band, where nothing changes; a replica removed can never
push the load of those left over the up threshold. A wish must hold at every sample for
``upscale_delay_s`` (``downscale_delay_s``, longer: bringing a replica back costs a node, a
weight load and a cold prefix cache) before one replica is added or removed, never more at
once; any decision, and any sample without the wish, starts the clock again. While a replica
is starting or draining nothing else is decided: its effect is not visible yet.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ReplicaSignals:
    """One replica's load at one sample."""

    waiting_prompt_tokens: int  # prompt tokens queued there and not computed yet
    running_seqs: int  # sequences in its running batch
    kv_usage: float  # KV blocks in use / all, 0 to 1
    ttft_p90_s: float | None = None  # over the last window; None: no first token in it


@dataclass(frozen=True)
class AutoscalingPolicy:
    """The targets are per replica; ``target_ttft_p90_s`` None leaves latency out (a fit target
    depends on the model, the prompts and the service level, so it has no default)."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_waiting_prompt_tokens: float = 4096.0
    target_running_seqs: float = 48.0
    target_kv_usage: float = 0.8
    target_ttft_p90_s: float | None = None
    tolerance: float = 0.1
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    # carried out by the cluster, not decided here
    interval_s: float = 1.0  # between samples
    ttft_window_s: float = 30.0  # the TTFT p90's window
    drain_timeout_s: float = 600.0  # a draining replica's requests get this long to finish

    def __post_init__(self) -> None:
        problems = []
        if self.min_replicas < 1:
            problems.append(f"min_replicas must be at least 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            problems.append(f"max_replicas ({self.max_replicas}) must be at least "
                            f"min_replicas ({self.min_replicas})")
        for name in ("target_waiting_prompt_tokens", "target_running_seqs", "target_kv_usage",
                     "target_ttft_p90_s", "interval_s", "ttft_window_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} must be more than 0, got {value}")
        if not 0 < self.target_kv_usage <= 1:
            problems.append(f"target_kv_usage is a share of the KV cache, in (0, 1], got "
                            f"{self.target_kv_usage}")
        if not 0 <= self.tolerance < 1:
            problems.append(f"tolerance must be in [0, 1), got {self.tolerance}")
        for name in ("upscale_delay_s", "downscale_delay_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative, got {getattr(self, name)}")
        if problems:
            raise ValueError("invalid autoscaling policy: " + "; ".join(problems))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class ScalingClock:
    """Since when the current wish has held (None: it does not)."""

    wants_up_since: float | None = None
    wants_down_since: float | None = None


@dataclass(frozen=True)
class ScalingDecision:
    delta: int  # +1 add a replica, -1 drain one, 0 nothing
    reason: str
    load_ratio: float  # the load over target, 1.0 = on target
    signal: str  # the signal that set load_ratio
    clock: ScalingClock  # pass to the next call


def load_ratio(signals: Sequence[ReplicaSignals],
               policy: AutoscalingPolicy) -> tuple[float, str]:
    """The load over target of the signal furthest over, and that signal's name."""
    if not signals:
        return 0.0, "none"
    n = len(signals)
    ratios = {
        "waiting_prompt_tokens": sum(s.waiting_prompt_tokens for s in signals) / n
        / policy.target_waiting_prompt_tokens,
        "running_seqs": sum(s.running_seqs for s in signals) / n / policy.target_running_seqs,
        "kv_usage": sum(s.kv_usage for s in signals) / n / policy.target_kv_usage,
    }
    ttfts = [s.ttft_p90_s for s in signals if s.ttft_p90_s is not None]
    if policy.target_ttft_p90_s is not None and ttfts:
        # latency does not add up over replicas: the worst one is what some clients see
        ratios["ttft_p90"] = max(ttfts) / policy.target_ttft_p90_s
    name = max(ratios, key=lambda key: ratios[key])  # ties: the first listed
    return ratios[name], name


def decide(policy: AutoscalingPolicy, signals: Sequence[ReplicaSignals], clock: ScalingClock,
           now: float, num_starting: int = 0, num_draining: int = 0) -> ScalingDecision:
    """One decision from the serving replicas' signals (starting and draining ones excluded)."""
    n = len(signals)
    ratio, signal = load_ratio(signals, policy)

    def hold(reason: str, next_clock: ScalingClock = ScalingClock()) -> ScalingDecision:
        return ScalingDecision(0, reason, ratio, signal, next_clock)

    if num_starting or num_draining:
        return hold("starting" if num_starting else "draining")
    if n < policy.min_replicas:
        return ScalingDecision(1, "below_min", ratio, signal, ScalingClock())
    if n > policy.max_replicas:
        return ScalingDecision(-1, "above_max", ratio, signal, ScalingClock())
    if n < policy.max_replicas and ratio > 1 + policy.tolerance:
        since = clock.wants_up_since if clock.wants_up_since is not None else now
        if now - since >= policy.upscale_delay_s:
            return ScalingDecision(1, "over_target", ratio, signal, ScalingClock())
        return hold("waiting_to_scale_up", ScalingClock(wants_up_since=since))
    if n > policy.min_replicas and ratio * n / (n - 1) < 1 - policy.tolerance:
        since = clock.wants_down_since if clock.wants_down_since is not None else now
        if now - since >= policy.downscale_delay_s:
            return ScalingDecision(-1, "under_target", ratio, signal, ScalingClock())
        return hold("waiting_to_scale_down", ScalingClock(wants_down_since=since))
    return hold("within_band" if policy.min_replicas < policy.max_replicas else "fixed")


def replica_to_drain(in_flight: Mapping[int, int]) -> int:
    """The replica to remove: the fewest requests in flight (its drain ends soonest); ties go to
    the newest, whose prefix cache has had the least time to warm."""
    if not in_flight:
        raise ValueError("no replica to drain")
    return min(in_flight, key=lambda replica: (in_flight[replica], -replica))

