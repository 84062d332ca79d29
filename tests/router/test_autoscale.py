"""The engine-replica autoscaling decision, exactly: targets, bounds, hysteresis, one replica a
decision, the delays, with a fake clock (the ``now`` argument)."""

import pytest

from router.autoscale import (
    AutoscalingPolicy,
    ReplicaSignals,
    ScalingClock,
    decide,
    load_ratio,
    replica_to_drain,
)

POLICY = AutoscalingPolicy(min_replicas=1, max_replicas=3, target_waiting_prompt_tokens=1000,
                           target_running_seqs=10, target_kv_usage=0.5, target_ttft_p90_s=2.0,
                           tolerance=0.1, upscale_delay_s=30, downscale_delay_s=600)


def load(waiting=0, running=0, kv=0.0, ttft=None):
    return ReplicaSignals(waiting, running, kv, ttft)


def run(signals_at, policy=POLICY):
    """decide() at each (time, signals) in turn; the decisions as (time, delta, reason)."""
    out, clock = [], ScalingClock()
    for now, signals in signals_at:
        decision = decide(policy, signals, clock, now)
        clock = decision.clock
        out.append((now, decision.delta, decision.reason))
    return out


def test_the_ratio_is_the_signal_furthest_over_its_target():
    assert load_ratio([load(waiting=500, running=5, kv=0.25)], POLICY) == (
        0.5, "waiting_prompt_tokens")
    assert load_ratio([load(running=30), load(running=0)], POLICY) == (1.5, "running_seqs")
    assert load_ratio([load(kv=0.6), load(kv=0.4)], POLICY) == (1.0, "kv_usage")
    # latency: the worst replica's p90, not the mean; replicas without one are left out
    assert load_ratio([load(ttft=1.0), load(ttft=5.0), load()], POLICY) == (2.5, "ttft_p90")
    assert load_ratio([load(ttft=9.0)], AutoscalingPolicy()) == (0.0, "waiting_prompt_tokens")
    assert load_ratio([], POLICY) == (0.0, "none")


def test_scaling_up_waits_for_the_delay_of_an_unbroken_wish():
    hot = [load(running=12)]  # 1.2 > 1 + tolerance
    assert run([(0, hot), (10, hot), (29.9, hot), (30, hot), (31, hot)]) == [
        (0, 0, "waiting_to_scale_up"), (10, 0, "waiting_to_scale_up"),
        (29.9, 0, "waiting_to_scale_up"), (30, 1, "over_target"),
        (31, 0, "waiting_to_scale_up"),  # the decision started the clock again
    ]


def test_one_sample_without_the_wish_starts_the_clock_again():
    hot, calm = [load(running=12)], [load(running=10)]  # 1.0 is inside the band
    assert run([(0, hot), (20, calm), (21, hot), (50, hot), (51, hot)]) == [
        (0, 0, "waiting_to_scale_up"), (20, 0, "within_band"), (21, 0, "waiting_to_scale_up"),
        (50, 0, "waiting_to_scale_up"), (51, 1, "over_target")]


def test_the_tolerance_is_a_band_on_both_sides():
    # up needs more than 1.1
    assert decide(POLICY, [load(running=11)], ScalingClock(), 0).reason == "within_band"
    assert decide(POLICY, [load(running=12)], ScalingClock(), 0).reason == "waiting_to_scale_up"
    # down from 2 needs the load on 1 replica under 0.9: a mean of 4.4 runs is 0.88 there
    assert decide(POLICY, [load(running=5), load(running=4)], ScalingClock(),
                  0).reason == "within_band"  # 4.5 a replica -> 0.9 on one
    assert decide(POLICY, [load(running=5), load(running=3)], ScalingClock(),
                  0).reason == "waiting_to_scale_down"


def test_hysteresis_removing_a_replica_never_makes_the_rest_want_one_back():
    # 16 runs on 3 replicas: on 2 they would be at 0.8 (< 0.9): down is allowed ...
    three = [load(running=5), load(running=5), load(running=6)]
    down = decide(POLICY, three, ScalingClock(wants_down_since=0), 600)
    assert (down.delta, down.reason) == (-1, "under_target")
    # ... and the same 16 on the 2 left are inside the band, not over it
    two = [load(running=8), load(running=8)]
    assert decide(POLICY, two, ScalingClock(), 601).reason == "within_band"


def test_scaling_down_takes_the_longer_delay():
    idle = [load(), load()]
    out = run([(0, idle), (30, idle), (599, idle), (600, idle)])
    assert out == [(0, 0, "waiting_to_scale_down"), (30, 0, "waiting_to_scale_down"),
                   (599, 0, "waiting_to_scale_down"), (600, -1, "under_target")]


def test_bounds_are_never_crossed_by_load_and_are_restored_at_once():
    at_max = [load(running=100)] * 3
    assert run([(0, at_max), (1000, at_max)]) == [(0, 0, "within_band"),
                                                  (1000, 0, "within_band")]
    at_min = [load()]
    assert run([(0, at_min), (1000, at_min)]) == [(0, 0, "within_band"),
                                                  (1000, 0, "within_band")]
    # outside the bounds (no replica yet, or a policy changed): one step at once, no delay
    assert decide(POLICY, [], ScalingClock(), 0).delta == 1
    assert decide(POLICY, [], ScalingClock(), 0).reason == "below_min"
    over = decide(POLICY, [load(running=100)] * 4, ScalingClock(), 0)
    assert (over.delta, over.reason) == (-1, "above_max")


def test_one_replica_a_decision_however_far_over():
    decision = decide(POLICY, [load(running=1000)], ScalingClock(wants_up_since=0), 30)
    assert decision.delta == 1 and decision.load_ratio == 100.0


def test_nothing_is_decided_while_a_replica_starts_or_drains():
    hot = [load(running=100)]
    starting = decide(POLICY, hot, ScalingClock(wants_up_since=0), 100, num_starting=1)
    assert (starting.delta, starting.reason, starting.clock) == (0, "starting", ScalingClock())
    draining = decide(POLICY, [load(), load()], ScalingClock(wants_down_since=0), 1000,
                      num_draining=1)
    assert (draining.delta, draining.reason) == (0, "draining")


def test_zero_delays_act_on_the_first_sample():
    fast = AutoscalingPolicy(min_replicas=1, max_replicas=2, target_running_seqs=2,
                             upscale_delay_s=0, downscale_delay_s=0)
    assert run([(0, [load(running=3)]), (1, [load(), load()])], policy=fast) == [
        (0, 1, "over_target"), (1, -1, "under_target")]


def test_a_fixed_count_never_moves():
    fixed = AutoscalingPolicy(min_replicas=2, max_replicas=2)
    assert run([(0, [load(running=1000)] * 2), (0, [load()] * 2)], policy=fixed) == [
        (0, 0, "fixed"), (0, 0, "fixed")]


def test_the_replica_to_drain_has_the_fewest_in_flight_then_is_the_newest():
    assert replica_to_drain({0: 3, 1: 0, 2: 1}) == 1
    assert replica_to_drain({0: 0, 2: 0, 1: 0}) == 2
    with pytest.raises(ValueError, match="no replica to drain"):
        replica_to_drain({})


@pytest.mark.parametrize(("options", "message"), [
    ({"min_replicas": 0}, "min_replicas must be at least 1, got 0"),
    ({"min_replicas": 3, "max_replicas": 2}, r"max_replicas \(2\) must be at least "
     r"min_replicas \(3\)"),
    ({"target_running_seqs": 0}, "target_running_seqs must be more than 0, got 0"),
    ({"target_kv_usage": 1.5}, r"target_kv_usage is a share of the KV cache, in \(0, 1\]"),
    ({"tolerance": 1.0}, r"tolerance must be in \[0, 1\), got 1.0"),
    ({"downscale_delay_s": -1}, "downscale_delay_s must not be negative, got -1"),
])
def test_a_bad_policy_is_refused_with_what_is_wrong(options, message):
    with pytest.raises(ValueError, match=message):
        AutoscalingPolicy(**options)
