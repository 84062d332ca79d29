"""Adaptive speculation: drafts while their expected tokens beat a plain step's rate."""

import pytest

from router.speculation import PRIOR_ALPHA, RETRY_EVERY, DraftLength, StepCost


def fitted(a: float, b: float) -> StepCost:
    cost = StepCost()
    for tokens in (1, 4, 16, 64):
        cost.add(tokens, a + b * tokens)
    return cost


def test_the_step_cost_is_fitted_from_two_sizes_or_more():
    cost = StepCost()
    assert cost.fit() is None
    cost.add(8, 0.01)
    cost.add(8, 0.01)
    assert cost.fit() is None  # one size: no slope
    a, b = fitted(0.004, 0.0001).fit()
    assert a == pytest.approx(0.004) and b == pytest.approx(0.0001)


def test_a_weight_bound_small_batch_drafts_while_a_large_one_does_not():
    lengths = DraftLength(max_drafts=5, cost=fitted(0.010, 0.00001))
    # batch 1: threshold 0.00001 / 0.01001 ~ 0.001: the prior 0.6 drafts all five
    assert lengths.threshold(1) == pytest.approx(0.00001 / 0.01001)
    assert lengths.choose("a", batch_size=1) == 5
    # batch 1000: threshold 0.01 / 0.02 = 0.5; 0.6 >= 0.5 but 0.36 < 0.5: one draft
    assert lengths.threshold(1000) == pytest.approx(0.5)
    assert lengths.choose("a", batch_size=1000) == 1
    compute_bound = DraftLength(max_drafts=5, cost=fitted(0.0, 0.001))  # threshold 1
    assert compute_bound.choose("a", batch_size=4) == 0


def test_acceptance_is_learnt_per_sequence_and_a_low_one_stops_drafting():
    lengths = DraftLength(max_drafts=4, cost=fitted(0.010, 0.0001))  # batch 8: 0.074
    for _ in range(20):
        lengths.record("bad", num_drafts=4, num_accepted=0)  # one try a step: the first
        lengths.record("good", num_drafts=4, num_accepted=4)  # four right
    assert lengths.seqs["bad"].alpha < 0.01 and lengths.seqs["good"].alpha > 0.99
    assert lengths.choose("good", batch_size=8) == 4
    assert [lengths.choose("bad", batch_size=8) for _ in range(RETRY_EVERY)] == (
        [0] * (RETRY_EVERY - 1) + [1])  # off, but tried again now and then
    lengths.forget("bad")
    assert "bad" not in lengths.seqs


def test_a_fixed_length_when_not_adaptive_and_the_prior_before_any_step():
    assert DraftLength(max_drafts=3, adaptive=False, cost=fitted(0.0, 1.0)).choose("a", 64) == 3
    fresh = DraftLength(max_drafts=3)
    assert fresh.threshold(64) == 0.0 and fresh.choose("a", 64) == 3  # nothing measured: try
    assert fresh.seqs["a"].alpha == PRIOR_ALPHA
    fresh.record("a", num_drafts=3, num_accepted=1)  # kept 1, the 2nd rejected, the 3rd untried
    assert fresh.seqs["a"].alpha == pytest.approx((0.8 * PRIOR_ALPHA + 0.2) * 0.8)

