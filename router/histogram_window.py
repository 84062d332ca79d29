"""A quantile of a histogram over the last few seconds, from the cumulative counts an engine
keeps: what came in the window is the newest counts less the counts of the sample taken when the
window began. Plain data; the autoscaler feeds it one sample a second.
"""

from collections import deque
from collections.abc import Sequence


def histogram_quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The q-quantile of observations counted per bucket (``counts`` has one more entry than
    ``bounds``: the +Inf bucket), interpolated linearly inside its bucket as Prometheus'
    ``histogram_quantile`` does; None when nothing was observed. A quantile in the +Inf bucket
    is the highest finite bound: the histogram cannot say more."""
    if not 0 <= q <= 1:
        raise ValueError(f"a quantile is between 0 and 1, got {q}")
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"{len(counts)} counts for {len(bounds)} bounds: give one more count "
                         "(the +Inf bucket)")
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for index, count in enumerate(counts):
        if count and below + count >= rank:
            if index == len(bounds):
                return bounds[-1]
            lower = bounds[index - 1] if index else 0.0
            return lower + (bounds[index] - lower) * (rank - below) / count
        below += count
    return bounds[-1]


class HistogramWindow:
    """Cumulative counts sampled over time; ``quantile`` covers what arrived in the last
    ``seconds``. A counter that went down (the engine was rebuilt) starts the window afresh."""

    def __init__(self, bounds: Sequence[float], seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"a window lasts more than 0 seconds, got {seconds}")
        self.bounds = tuple(bounds)
        self.seconds = seconds
        self.samples: deque[tuple[float, tuple[int, ...]]] = deque()

    def add(self, now: float, counts: Sequence[int]) -> None:
        counts = tuple(counts)
        if self.samples and any(new < old for new, old in zip(counts, self.samples[-1][1],
                                                              strict=True)):
            self.samples.clear()
        self.samples.append((now, counts))
        # keep the newest sample at or before the window's start: the baseline to subtract
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.seconds:
            self.samples.popleft()

    def quantile(self, q: float) -> float | None:
        """None until two samples: the first is only the baseline (its counts may be old)."""
        if len(self.samples) < 2:
            return None
        (_, first), (_, last) = self.samples[0], self.samples[-1]
        return histogram_quantile(self.bounds, [b - a for a, b in zip(first, last, strict=True)],
                                  q)
