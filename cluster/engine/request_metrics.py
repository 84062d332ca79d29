"""A request's share of the engine's metrics, as its tokens come and as it finishes."""

from cluster.engine.metrics import EngineMetrics
from cluster.engine.output_processor import CompletionTracker, RequestTracker
from router.sequence import Sequence


def record_tokens(metrics: EngineMetrics, tracker: RequestTracker,
                  completion: CompletionTracker,
                  seq: Sequence, now: float, count: int, num_sampled: int) -> None:
    """Metrics of ``count`` new output tokens of one completion, the first ``count`` of
    the ``num_sampled`` its call returned: a call of k decode steps spreads its time over
    its k tokens for the inter-token latency, as if they had come one at a time."""
    if not count:
        return
    metrics.generation_tokens += count
    last = completion.last_token_time
    if last is None:  # the first token: time to first token and queue time
        last = completion.last_token_time = now
        count -= 1
        if tracker.metrics.first_token_time is None:
            tracker.metrics.first_token_time = now
            arrival = tracker.metrics.arrival_time
            scheduled = tracker.metrics.first_scheduled_time = seq.first_scheduled_time or arrival
            metrics.on_first_token(len(tracker.prompt_token_ids), now - arrival,
                                        scheduled - arrival)
    if count:
        gap = (now - last) / num_sampled
        metrics.inter_token_latency.observe(gap, times=count)
        completion.last_token_time = last + gap * count

def record_finish(metrics: EngineMetrics, tracker: RequestTracker, seq: Sequence,
                  now: float) -> None:
    tracker.metrics.num_cached_tokens = max(seq.num_cached_tokens, 0)
    tracker.metrics.num_preemptions += seq.num_preemptions
    if tracker.finished:
        tracker.metrics.finished_time = now
        reason = next(iter(tracker.completions.values())).output.finish_reason or "abort"
        generated = sum(len(c.output.token_ids) for c in tracker.completions.values())
        metrics.on_finish(reason, now - tracker.metrics.arrival_time, generated)
        if reason == "abort":
            return
        first, scheduled = tracker.metrics.first_token_time, tracker.metrics.first_scheduled_time
        prefill = decode = None
        if first is not None and scheduled is not None:
            prefill, decode = first - scheduled, now - first
        metrics.on_request_done(len(tracker.prompt_token_ids), generated, prefill, decode)
