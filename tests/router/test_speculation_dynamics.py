"""Adaptive speculation step after step, against an engine's costs as an H100 measured them
(Llama-3.1-8B shape, a Llama-3.2-1B draft): the decisions, the fit and the acceptance
estimates together, as the engine runs them. A step where nobody drafts is a plain call of 8
decode steps; a verify call is one step with the draft's forwards and its catch-up."""

import random

import pytest

from router.speculation import DraftLength

TARGET_STEP, TARGET_TOKEN = 5.50e-3, 0.07e-3  # 5.55 ms at batch 1, 6.09 at batch 8
VERIFY_CALL = 1.0e-3  # host work of a single-step call
DRAFT_STEP, DRAFT_TOKEN = 0.95e-3, 0.01e-3  # a draft graph's replay
CATCH_UP_CALL, CATCH_UP_TOKEN = 0.9e-3, 0.005e-3  # the draft's forward over what it missed
PLAIN_CALL_STEPS = 8
PROMPT, OUTPUT = 128, 256


def speedup(batch: int, alpha: float, adaptive: bool, seed: int) -> float:
    """Plain decoding's time over speculation's for OUTPUT tokens a row; the draft's tokens
    are accepted with probability ``alpha`` each (an oracle, as W5's)."""
    rng = random.Random(seed)
    lengths = DraftLength(max_drafts=4, adaptive=adaptive)
    rows = [str(i) for i in range(batch)]
    made, seen = [0] * batch, [0] * batch  # tokens made; tokens the draft has seen
    seconds = 0.0
    while min(made) < OUTPUT:
        chosen = lengths.choose(rows, batch)
        ks = [chosen[row] for row in rows]
        if not any(ks):
            call = PLAIN_CALL_STEPS * (TARGET_STEP + TARGET_TOKEN * batch)
            lengths.costs.add(call, PLAIN_CALL_STEPS, PLAIN_CALL_STEPS * batch)
            seconds += call
            made = [m + PLAIN_CALL_STEPS for m in made]
            continue
        drafts, longest = sum(ks), max(ks)
        catch_up = sum(PROMPT + made[i] - seen[i] for i in range(batch) if ks[i])
        call = (TARGET_STEP + TARGET_TOKEN * (batch + drafts) + VERIFY_CALL
                + DRAFT_STEP * longest + DRAFT_TOKEN * drafts
                + CATCH_UP_CALL + CATCH_UP_TOKEN * catch_up)
        lengths.costs.add(call, 1, batch + drafts, 1, longest, drafts, catch_up)
        seconds += call
        for i, row in enumerate(rows):
            kept = 0
            while kept < ks[i] and rng.random() < alpha:
                kept += 1
            if ks[i]:
                lengths.record(row, ks[i], kept)
                seen[i] = PROMPT + made[i] + kept
            made[i] += kept + 1
    return OUTPUT * (TARGET_STEP + TARGET_TOKEN * batch) / seconds


def mean_speedup(batch: int, alpha: float, adaptive: bool) -> float:
    return sum(speedup(batch, alpha, adaptive, seed) for seed in range(5)) / 5


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_an_unrelated_draft_costs_little(batch):
    # drafting every step would run at 0.32-0.48x
    assert mean_speedup(batch, 0.0, adaptive=False) < 0.5
    assert mean_speedup(batch, 0.0, adaptive=True) > 0.93


@pytest.mark.parametrize("batch", [1, 8])
def test_a_good_draft_keeps_most_of_what_drafting_every_step_makes(batch):
    fixed = mean_speedup(batch, 0.8, adaptive=False)
    adaptive = mean_speedup(batch, 0.8, adaptive=True)
    assert fixed > 1.25 and adaptive > 0.9 * fixed


def test_where_drafts_do_not_pay_speculation_stays_near_plain():
    # batch 32: a verify step costs what the tokens it adds are worth
    assert mean_speedup(32, 0.8, adaptive=False) < 1.0
    assert mean_speedup(32, 0.8, adaptive=True) > 0.92
