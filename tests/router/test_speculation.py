"""Adaptive speculation: drafts while their expected tokens, over every cost they add (the
target's tokens, a draft model's steps and tokens, the proposer's host time), beat a plain
step's rate."""

import numpy as np
import pytest

from router.speculation import (
    ALPHA_MEMORY,
    PRIOR_ALPHA,
    RETRY_AFTER,
    RETRY_SHARE,
    Acceptance,
    Costs,
    DraftLength,
    StepCosts,
)


def fitted(a: float, b: float, g: float = 0.0, h: float = 0.0) -> StepCosts:
    """Costs measured from plain calls of several sizes and, when the draft costs anything,
    verify calls of several batches and lengths."""
    costs = StepCosts()
    for batch in (1, 4, 16, 64):
        costs.add(a + b * batch, steps=1, tokens=batch)
        costs.add(4 * (a + b * batch), steps=4, tokens=4 * batch)  # a multi-step call
    if g or h:
        for batch in (1, 8):
            for k in (1, 2, 4):
                costs.add(a + b * batch * (1 + k) + g * k + h * batch * k, steps=1,
                          tokens=batch * (1 + k), verifies=1, draft_steps=k,
                          draft_tokens=batch * k)
    return costs


def test_the_costs_are_fitted_from_the_calls():
    assert StepCosts().fit() is None
    assert fitted(0.004, 0.0001, 0.002, 0.00005).fit() == pytest.approx(
        (0.004, 0.0001, 0.0, 0.002, 0.00005, 0.0), rel=1e-6, abs=1e-9)
    # calls of one size only: a step's time is known, not how it splits
    one_size = StepCosts()
    for _ in range(3):
        one_size.add(0.01, steps=1, tokens=1)
    a, b, c, g, h, u = one_size.fit()
    assert a + b == pytest.approx(0.01) and (c, g, h, u) == (0.0, 0.0, 0.0, 0.0)


def test_calls_of_batch_1_alone_fit_with_no_negative_cost_and_drafts_pay():
    # a GPU at batch 1: 8-step plain calls of 5.8 ms a step, and two verify calls of 4 drafts
    # (a draft model's four forwards) at 11.6 ms. Only a + b and a + 5b + 4g + 4h are known:
    # a fit with g and h below 0, clamped, said a verify costs 17 ms and stopped drafting
    costs = StepCosts()
    for _ in range(2):
        costs.add(0.0116, steps=1, tokens=5, verifies=1, draft_steps=4, draft_tokens=4)
    for _ in range(10):
        costs.add(8 * 0.0058, steps=8, tokens=8)
    a, b, c, g, h, u = costs.fit()
    assert min(a, b, c, g, h, u) >= 0
    assert a + b == pytest.approx(0.0058, rel=1e-4)
    assert a + 5 * b + c + 4 * (g + h) == pytest.approx(0.0116, rel=1e-4)
    assert b < 0.0001  # what is left open goes to the step
    lengths = DraftLength(max_drafts=4, costs=costs)
    lengths.seqs["a"] = Acceptance(alpha=0.8)
    # 1 + .8 + .64 + .512 + .41 = 3.36 tokens in the measured 11.6 ms beat 1 in 5.8 (and
    # 2.95 in the 10.6 ms the fit gives three drafts)
    assert lengths.choose(["a"], batch_size=1) == {"a": 4}


def test_a_verify_call_s_own_cost_is_not_read_as_a_price_per_draft():
    # a GPU at batch 8 (H100, 8B/1B shapes): 8-step plain calls of 6.09 ms a step; verify
    # calls of 4 drafts a row at 13.45 ms, and retries of one draft for one row at 12.6 ms
    # (one step where plain runs eight, the draft's catch-up). Without a term for the call,
    # a draft token was priced at 6.5 ms and batch 8 stopped drafting at alpha 0.8
    costs = StepCosts()
    for _ in range(10):
        costs.add(8 * 0.00609, steps=8, tokens=64)
    for _ in range(3):
        costs.add(0.01345, steps=1, tokens=40, verifies=1, draft_steps=4, draft_tokens=32)
        costs.add(0.0126, steps=1, tokens=9, verifies=1, draft_steps=1, draft_tokens=1)
    a, b, c, g, h, u = costs.fit()
    assert min(a, b, c, g, h, u) >= 0
    assert a + 40 * b + c + 4 * g + 32 * h == pytest.approx(0.01345, rel=1e-3)
    assert a + 9 * b + c + g + h == pytest.approx(0.0126, rel=1e-3)
    assert b + h < 0.0005  # a draft's own price is what the two verify calls differ by
    lengths = DraftLength(max_drafts=4, costs=costs)
    rows = [str(i) for i in range(8)]
    for row in rows:
        lengths.seqs[row] = Acceptance(alpha=0.8)
    # 8 x 3.36 tokens in 13.45 ms beat 8 in 6.09 and 8 x 1.8 in ~12.7
    assert lengths.choose(rows, batch_size=8) == dict.fromkeys(rows, 4)


def batch_8_calls(count_catch_up: bool) -> StepCosts:
    """H100, 8B / 1B shapes, batch 8: 8-step plain calls of 5.55 ms a step; the first verify
    (the draft catches up on 8 prompts of 129 tokens) at 30 ms; verifies of 4 drafts a row at
    13.45 ms (about 27 tokens caught up); retries of one draft a row at 15.9 ms (17 each)."""
    def caught(tokens: int) -> int:
        return tokens if count_catch_up else 0

    costs = StepCosts()
    for _ in range(10):
        costs.add(8 * 0.00555, steps=8, tokens=64)
    costs.add(0.030, steps=1, tokens=40, verifies=1, draft_steps=4, draft_tokens=32,
              catch_up_tokens=caught(8 * 129))
    for _ in range(2):
        costs.add(0.01345, steps=1, tokens=40, verifies=1, draft_steps=4, draft_tokens=32,
                  catch_up_tokens=caught(27))
        costs.add(0.0159, steps=1, tokens=16, verifies=1, draft_steps=1, draft_tokens=8,
                  catch_up_tokens=caught(8 * 17))
    return costs


def test_what_a_draft_catches_up_on_is_not_read_as_a_price_per_draft():
    rows = [str(i) for i in range(8)]
    chosen = {}
    for count_catch_up in (True, False):
        lengths = DraftLength(max_drafts=4, costs=batch_8_calls(count_catch_up))
        for row in rows:
            lengths.seqs[row] = Acceptance(alpha=0.8)
        chosen[count_catch_up] = lengths.choose(rows, batch_size=8)
    # 8 x 3.36 tokens in ~13.5 ms beat 8 in 5.55: drafting pays at alpha 0.8; priced without
    # the prompts' catch-up, a draft seemed to cost what the first verify's catch-up did
    assert chosen[True] == dict.fromkeys(rows, 4)
    assert chosen[False] == dict.fromkeys(rows, 0)


def test_a_weight_bound_small_batch_drafts_while_a_large_one_does_not():
    lengths = DraftLength(max_drafts=5, costs=fitted(0.010, 0.00001))
    # batch 1: a draft pays at alpha^j >= 0.00001 / 0.01001 ~ 0.001: the prior drafts five
    assert lengths.choose(["a"], batch_size=1) == {"a": 5}
    # batch 1000: a plain step makes 1000 tokens in 0.02 s; 0.6 >= 0.00001 * 50,000 = 0.5
    # but 0.36 is not: one draft each
    many = [str(i) for i in range(1000)]
    assert set(lengths.choose(many, batch_size=1000).values()) == {1}
    compute_bound = DraftLength(max_drafts=5, costs=fitted(0.0, 0.001))
    assert compute_bound.choose(["a"], batch_size=4) == {"a": 0}


def test_a_draft_model_s_own_cost_is_in_the_decision():
    # the draft's step costs 0.4 of the target's: at the prior 0.6 one draft pays (1.6 tokens
    # in 1.4 steps), two do not (1.96 in 1.8)
    lengths = DraftLength(max_drafts=4, costs=fitted(0.010, 0.00001, g=0.004))
    assert lengths.choose(["a"], batch_size=1) == {"a": 1}
    # free drafts at the same acceptance: all four
    assert DraftLength(max_drafts=4, costs=fitted(0.010, 0.00001)).choose(
        ["a"], batch_size=1) == {"a": 4}
    # at acceptance 0.2 the draft's step costs more than it brings: off
    for _ in range(4):
        lengths.record("a", num_drafts=1, num_accepted=0)
    assert lengths.seqs["a"].alpha == pytest.approx(PRIOR_ALPHA * ALPHA_MEMORY ** 4)
    assert lengths.choose(["a"], batch_size=1) == {"a": 0}


def test_the_proposer_s_host_time_is_in_the_decision():
    lengths = DraftLength(max_drafts=3, costs=fitted(0.010, 0.00001))
    lengths.observe_proposer(0.020, asked=1)  # a search twice as long as a step, each row
    # 1 + 0.6 + 0.36 + 0.216 tokens in 3 steps' time: less than plain's 1 token in 1
    assert lengths.choose(["a"], batch_size=1) == {"a": 0}


def test_acceptance_is_learnt_per_sequence_and_a_low_one_stops_drafting_for_longer_each_try():
    lengths = DraftLength(max_drafts=4, costs=fitted(0.010, 0.0001))
    for _ in range(50):
        lengths.record("bad", num_drafts=4, num_accepted=0)  # one try a step: the first
        lengths.record("good", num_drafts=4, num_accepted=4)  # four right
    assert lengths.seqs["bad"].alpha < 0.01 and lengths.seqs["good"].alpha > 0.99

    def tries(steps: int) -> list[int]:
        return [lengths.choose(["bad"], batch_size=8)["bad"] for _ in range(steps)]

    assert tries(RETRY_AFTER) == [0] * (RETRY_AFTER - 1) + [1]  # off, then tried again
    lengths.record("bad", num_drafts=1, num_accepted=0)  # the try failed: twice as long
    assert tries(2 * RETRY_AFTER) == [0] * (2 * RETRY_AFTER - 1) + [1]
    lengths.record("bad", num_drafts=1, num_accepted=1)  # a try that paid: back to the start
    assert lengths.seqs["bad"].retry_after == RETRY_AFTER
    assert lengths.choose(["good"], batch_size=8) == {"good": 4}
    lengths.forget("bad")
    assert "bad" not in lengths.seqs


def test_sequences_that_paused_at_different_steps_are_tried_in_the_same_one():
    # every verify call costs the whole batch a single step: tries share them
    lengths = DraftLength(max_drafts=4, costs=fitted(0.010, 0.0001))
    lengths.seqs["early"] = Acceptance(alpha=0.0)
    tried = {"early": [], "late": []}
    for step in range(1, 3 * RETRY_AFTER + 1):
        if step == 5:
            lengths.seqs["late"] = Acceptance(alpha=0.0)  # off from step 5
        for request_id, k in lengths.choose(list(lengths.seqs), batch_size=2).items():
            if k:
                tried[request_id].append(step)
                lengths.record(request_id, num_drafts=k, num_accepted=0)
    # early: off 16 steps at step 16, then 32 more at 48; late: 16 steps off at step 20,
    # tried at the next multiple of 16, 32, then 32 more at 64 (past the loop)
    assert tried == {"early": [RETRY_AFTER, 3 * RETRY_AFTER], "late": [2 * RETRY_AFTER]}


def test_with_no_plain_call_in_the_fit_the_next_step_is_plain():
    # verify calls alone: the fit gives all their time to the target's step, which makes
    # any draft look free; one plain call (8 steps of decode) says what a step costs
    costs = StepCosts()
    for _ in range(3):
        costs.add(0.0116, steps=1, tokens=5, verifies=1, draft_steps=4, draft_tokens=4)
    lengths = DraftLength(max_drafts=4, costs=costs)
    lengths.seqs["a"] = Acceptance(alpha=0.0)
    assert lengths.choose(["a"], batch_size=1) == {"a": 0}
    costs.add(8 * 0.0058, steps=8, tokens=8)
    lengths.seqs["b"] = Acceptance(alpha=0.9)
    assert lengths.choose(["a", "b"], batch_size=2) == {"a": 0, "b": 4}


def test_a_fixed_length_when_not_adaptive_and_the_most_before_any_call():
    fixed = DraftLength(max_drafts=3, adaptive=False, costs=fitted(0.0, 1.0))
    assert fixed.choose(["a", "b"], 64) == {"a": 3, "b": 3}
    fresh = DraftLength(max_drafts=3)
    assert fresh.choose(["a"], 64) == {"a": 3}  # nothing measured: try, and measure
    assert fresh.seqs["a"].alpha == PRIOR_ALPHA
    fresh.record("a", num_drafts=3, num_accepted=1)  # kept 1, the 2nd rejected, the 3rd untried
    memory = ALPHA_MEMORY
    assert fresh.seqs["a"].alpha == pytest.approx((memory * PRIOR_ALPHA + 1 - memory) * memory)


class KnownCosts(StepCosts):
    """Costs as given (a, b, c, g, h, u), with plain calls in the fit."""

    def __init__(self, *costs: float) -> None:
        super().__init__(plain=1.0)
        self.known = Costs(*costs)

    def fit(self) -> Costs:
        return self.known


def tries_of_a_paused_sequence(batch: int, costs: KnownCosts, steps: int) -> list[int]:
    """The steps at which a sequence whose draft is always wrong is tried; it makes one
    token a step, from 100."""
    lengths = DraftLength(max_drafts=4, costs=costs)
    lengths.seqs["bad"] = Acceptance(alpha=0.0, seen=100)
    tried = []
    for step in range(1, steps + 1):
        if lengths.choose(["bad"], batch_size=batch, num_tokens=[100 + step])["bad"]:
            tried.append(step)
            lengths.record("bad", num_drafts=1, num_accepted=0)
    return tried


def test_a_try_waits_until_its_catch_up_and_verify_cost_at_most_a_share_of_the_plain_time():
    # batch 1, a 5 ms step: a try costs 1 ms of draft token, 2 ms of verify call and draft
    # step, and 0.05 ms a missed token; RETRY_SHARE of 5 ms a token pays for it from 60
    # missed tokens: the first aligned step past both 16 steps off and 60 tokens is 64, the
    # next (32 steps off, 60 tokens) 128, then 64 steps off: 192
    costs = KnownCosts(5e-3, 0.0, 1e-3, 1e-3, 1e-3, 0.05e-3)
    assert pytest.approx(1e-3 + 2e-3 + 0.05e-3 * 60) == RETRY_SHARE * 5e-3 * 60
    assert tries_of_a_paused_sequence(1, costs, 200) == [64, 128, 192]


def test_at_a_large_batch_a_draft_whose_catch_up_costs_more_than_the_share_is_never_tried():
    # batch 64: a token of plain decoding costs 5 ms / 64; the catch-up alone, 3 us a token
    # (an H100's 1B draft beside an 8B target), is ~4% of it
    costs = KnownCosts(5e-3, 0.0, 8e-3, 4.8e-3, 0.0, 3e-6)
    assert tries_of_a_paused_sequence(64, costs, 2000) == []
    assert tries_of_a_paused_sequence(64, KnownCosts(5e-3, 0.0, 8e-3, 4.8e-3, 0.0, 0.0),
                                      2000)  # a free catch-up (prompt lookup): tried


def test_sequences_that_start_together_learn_from_each_others_drafts():
    # batch 8, an H100's 8B target and 1B draft: the first verify call (every sequence
    # rejects its first draft) is evidence about the draft, 8 observations, not 1 each
    h100 = (5.4e-3, 0.03e-3, 0.75e-3, 0.95e-3, 0.04e-3, 0.013e-3)
    lengths = DraftLength(max_drafts=4, costs=KnownCosts(*h100))
    rows = [f"r{i}" for i in range(8)]
    first = lengths.choose(rows, batch_size=8)
    assert set(first.values()) == {2}  # the prior, 0.6
    for row in rows:
        lengths.record(row, num_drafts=2, num_accepted=0)
    assert lengths.pool_alpha == pytest.approx(0.32, abs=0.005)
    assert lengths.estimate(lengths.seqs["r0"]) == pytest.approx(0.29, abs=0.005)
    assert lengths.choose(rows, batch_size=8) == dict.fromkeys(rows, 0)
    # each on its own evidence, one rejection leaves a sequence at 0.54: the batch drafts on
    assert lengths.seqs["r0"].alpha == pytest.approx(0.54)
    alone = DraftLength(max_drafts=4, costs=KnownCosts(*h100))
    alone.seqs = {row: Acceptance(alpha=0.54) for row in rows}
    assert set(alone.choose(rows, batch_size=8).values()) == {1}


def test_the_nonnegative_fit_is_the_best_of_every_subset_fit():
    """The active-set solve finds what trying all 63 subsets of the six costs found."""
    import itertools

    from router.speculation import FEATURES, _least_squares, _loss, _nonnegative_least_squares

    rng = np.random.default_rng(0)
    for trial in range(300):
        calls = rng.uniform(0.1, 50, size=(int(rng.integers(6, 40)), FEATURES))
        calls *= rng.integers(0, 2, size=(1, FEATURES))  # some costs never seen
        if trial % 3 == 0:
            calls[:, 1] = calls[:, 0]  # batch 1: a plain call's tokens are its steps
        seconds = calls @ rng.normal(size=FEATURES) * 1e-3 + rng.normal(size=len(calls)) * 1e-4
        xtx, xty = calls.T @ calls, calls.T @ seconds
        scale = np.sqrt(np.maximum(np.diag(xtx), 1e-30))
        gram, target = xtx / np.outer(scale, scale), xty / scale
        subsets = [_least_squares(gram, target, free) for size in range(1, FEATURES + 1)
                   for free in itertools.combinations(range(FEATURES), size)]
        best = min((fit for fit in subsets if np.all(fit >= 0)),
                   key=lambda fit: _loss(gram, target, fit), default=np.zeros(FEATURES))
        fast = _nonnegative_least_squares(gram, target)
        assert np.all(fast >= 0)
        assert _loss(gram, target, fast) <= _loss(gram, target, best) + 1e-12 * abs(
            _loss(gram, target, best))


def test_while_every_sequence_is_off_the_choice_needs_no_fit_until_a_try():
    """Nothing drafted and nothing learnt: the next choices are the same without refitting
    (a fit a call was the host's largest cost of speculation that is off); the try's step
    fits again, and so does the step after a verify or a new sequence."""
    lengths = DraftLength(max_drafts=4, costs=fitted(0.010, 0.0001))
    lengths.seqs["a"] = Acceptance(alpha=0.0)
    fits = []
    fit = lengths.costs.fit
    lengths.costs.fit = lambda: fits.append(lengths.steps) or fit()  # type: ignore[method-assign]
    choices = [lengths.choose(["a"], batch_size=1)["a"] for _ in range(RETRY_AFTER)]
    assert choices == [0] * (RETRY_AFTER - 1) + [1] and fits == [1, RETRY_AFTER]
    lengths.record("a", num_drafts=1, num_accepted=0)
    assert lengths.choose(["a"], batch_size=1) == {"a": 0}
    assert lengths.choose(["a", "b"], batch_size=2) == {"a": 0, "b": 4}  # a new one
    assert fits == [1, RETRY_AFTER, RETRY_AFTER + 1, RETRY_AFTER + 2]
