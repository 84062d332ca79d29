"""Quantiles of cumulative histogram counts over a sliding window, as the autoscaler's TTFT p90."""

import pytest

from router.histogram_window import HistogramWindow, histogram_quantile

BOUNDS = (0.1, 0.5, 1.0)


def test_the_quantile_interpolates_inside_its_bucket_as_prometheus_does():
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.5], 2 in (0.5, 1.0]
    counts = [4, 4, 2, 0]
    assert histogram_quantile(BOUNDS, counts, 0.4) == pytest.approx(0.1)
    assert histogram_quantile(BOUNDS, counts, 0.6) == pytest.approx(0.3)
    assert histogram_quantile(BOUNDS, counts, 0.9) == pytest.approx(0.75)
    assert histogram_quantile(BOUNDS, counts, 0.2) == pytest.approx(0.05)
    # in the +Inf bucket: the highest finite bound
    assert histogram_quantile(BOUNDS, [0, 0, 1, 9], 0.9) == 1.0
    assert histogram_quantile(BOUNDS, [0, 0, 0, 0], 0.9) is None


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="between 0 and 1"):
        histogram_quantile(BOUNDS, [0, 0, 0, 0], 1.5)
    with pytest.raises(ValueError, match=r"3 counts for 3 bounds: give one more count"):
        histogram_quantile(BOUNDS, [0, 0, 0], 0.5)
    with pytest.raises(ValueError, match="more than 0 seconds"):
        HistogramWindow(BOUNDS, 0)


def test_the_window_counts_only_what_arrived_in_its_last_seconds():
    window = HistogramWindow(BOUNDS, seconds=10)
    window.add(0, [100, 0, 0, 0])  # old, fast: the baseline
    assert window.quantile(0.9) is None  # one sample is a baseline only
    window.add(5, [100, 0, 10, 0])  # 10 slow ones since
    assert window.quantile(0.9) == pytest.approx(0.95)
    window.add(12, [110, 0, 10, 0])  # the baseline is now the sample at 0 ... 5 (<= 12 - 10)
    assert [t for t, _ in window.samples] == [0, 5, 12]
    window.add(15, [110, 0, 10, 0])
    # the sample at 5 is the newest at or before 15 - 10: only the 10 fast ones since count
    assert [t for t, _ in window.samples] == [5, 12, 15]
    assert window.quantile(0.9) == pytest.approx(0.09)


def test_counts_that_went_down_start_the_window_again():
    window = HistogramWindow(BOUNDS, seconds=10)
    window.add(0, [5, 5, 5, 0])
    window.add(1, [1, 0, 0, 0])  # the engine was rebuilt: counting from zero
    assert [t for t, _ in window.samples] == [1]
    assert window.quantile(0.5) is None
