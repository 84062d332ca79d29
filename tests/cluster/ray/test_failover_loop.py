"""The failover loop over scripted attempts, without Ray: what each continuation is given,
when it gives up, and which errors count as a lost replica."""

import asyncio

import pytest
import ray

from cluster.engine.outputs import CompletionDelta, OutputAccumulator, RequestDelta, RequestMetrics
from cluster.engine.resume import Resume, ResumedCompletion
from cluster.ray.failover import ReplicaLost, process_died, with_failover
from cluster.ray.refusals import NoReplicaAvailable, Overloaded
from cluster.ray.replica import ReplicaFailure
from cluster.ray.replica_streams import StreamClosed
from cluster.ray.serving_policy import ServingPolicy


def delta(tokens: list[int], first: bool, finished: bool = False) -> RequestDelta:
    return RequestDelta("r", [CompletionDelta(0, tokens, "", None, "length" if finished else None,
                                              None)], RequestMetrics(0.0), finished,
                        prompt_token_ids=[1, 2] if first else None)


class Script:
    """Attempt i yields the deltas of ``plans[i]`` into the accumulator, then raises what the
    plan ends with (or finishes)."""

    def __init__(self, accumulator: OutputAccumulator, plans: list[tuple[list, object]]):
        self.accumulator, self.plans = accumulator, plans
        self.calls: list[tuple[Resume | None, frozenset[int]]] = []
        self.closed = 0

    async def attempt(self, resume, lost):
        self.calls.append((resume, lost))
        deltas, end = self.plans[min(len(self.calls) - 1, len(self.plans) - 1)]
        try:
            for d in deltas:
                await asyncio.sleep(0)
                yield self.accumulator.add(d)
            if end is not None:
                raise end
        finally:
            self.closed += 1


def run(script: Script, policy: ServingPolicy | None = None) -> list[list[int]]:
    policy = policy or ServingPolicy()

    async def go():
        return [list(o.token_ids) async for o in with_failover("r", script.attempt,
                                                                script.accumulator, policy)]

    return asyncio.run(go())


def test_a_lost_attempt_continues_from_what_was_sent_and_avoids_that_replica():
    accumulator = OutputAccumulator()
    script = Script(accumulator, [
        ([delta([5], True), delta([6, 7], False)], ReplicaLost(1, ReplicaFailure("x"), False)),
        ([delta([8], True), delta([9], False, finished=True)], None),
    ])
    assert run(script) == [[5], [5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8, 9]]
    (first, none_lost), (resume, lost) = script.calls
    assert (first, none_lost) == (None, frozenset())
    assert lost == frozenset({1})
    assert resume.completions == (ResumedCompletion((5, 6, 7)),) and resume.elapsed_s >= 0
    assert script.closed == 2


def test_a_replica_lost_before_any_output_is_retried_without_a_resume():
    accumulator = OutputAccumulator()
    script = Script(accumulator, [([], ReplicaLost(0, ray.exceptions.ActorDiedError(), True)),
                                  ([delta([3], True, finished=True)], None)])
    assert run(script) == [[3]]
    assert [resume for resume, _ in script.calls] == [None, None]


def test_no_replica_within_the_failover_timeout_is_a_503_to_retry():
    script = Script(OutputAccumulator(), [([], ReplicaLost(0, StreamClosed("gone"), True))])
    with pytest.raises(NoReplicaAvailable) as error:
        run(script, ServingPolicy(failover_timeout_s=0.6, retry_after_s=4))
    assert error.value.retry_after_s == 4
    assert str(error.value) == ("The engine replica running this request was lost and no other "
                                "could take it over: retry the request.")
    # backed off between tries (0, 0.25, 0.5 s...), not spinning
    assert 2 <= len(script.calls) <= 5


def test_errors_that_are_not_a_lost_replica_end_the_request():
    script = Script(OutputAccumulator(), [([], Overloaded("full", 2))])
    with pytest.raises(Overloaded):
        run(script)
    assert len(script.calls) == 1


@pytest.mark.parametrize(("error", "died"), [
    (ray.exceptions.ActorDiedError(), True),
    (ray.exceptions.ActorUnavailableError("restarting", None), True),
    (StreamClosed("the replica closed its stream"), True),
    (ReplicaFailure("replica 0 lost a shard"), False),
    (ValueError("prompt is empty"), None),
    (RuntimeError("anything else"), None),
])
def test_which_errors_mean_the_replica_was_lost(error, died):
    assert process_died(error) is died
