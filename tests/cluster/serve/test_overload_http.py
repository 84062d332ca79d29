"""Refusals over HTTP: a cluster that cannot take a request now gives 503 with Retry-After in
OpenAI's error body, at once, before or during a stream; a request past its deadline is
stopped with a 504. Over fake clusters, without Ray. Nothing here depends on how fast the
machine is: a slow request stalls far past its deadline (or the deadline's clock is moved)."""

import asyncio
import time

import pytest

from cluster.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cluster.ray.refusals import Draining, NoReplicaAvailable, Overloaded
from cluster.serve import deadlines
from tests.cluster.serve.test_error_bodies import FailingCluster
from tests.cluster.serve.test_protocol import FakeCluster, events, make_client, run

OVERLOADED = Overloaded("The server is overloaded (every engine replica's queue is full): "
                        "retry the request later.", 3)


def post(cluster, body, headers=None, **config):
    async def go():
        async with make_client(cluster, **config) as client:
            return await client.post("/v1/completions", json=body, headers=headers)

    return run(go())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("error", "code"), [
    (OVERLOADED, "overloaded"),
    (Draining("The server is shutting down and takes no new requests: retry the request.", 3),
     "draining"),
    (NoReplicaAvailable("The engine replica running this request was lost and no other could "
                        "take it over: retry the request.", 3), "no_replica_available"),
])
def test_a_request_the_cluster_cannot_take_is_a_503_with_retry_after(error, code, stream):
    cluster = FailingCluster(error)
    response = post(cluster, {"prompt": [1], "stream": stream})
    assert len(cluster.started) == 1  # at once: asked once, neither retried nor waited for
    # before the first token even a streamed request is answered with a status, not events
    assert (response.status_code, response.headers["retry-after"]) == (503, "3")
    assert response.json() == {"error": {"message": str(error), "type": "service_unavailable",
                                         "param": None, "code": code}}


def test_a_stream_no_replica_could_continue_ends_with_the_503_as_an_event():
    error = NoReplicaAvailable("The engine replica running this request was lost and no other "
                               "could take it over: retry the request.", 3)
    response = post(FailingCluster(error, after=2), {"prompt": [1], "stream": True})
    chunks = events(response.text)
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["He", "ll"]
    assert chunks[2] == {"error": {"message": str(error), "type": "service_unavailable",
                                   "param": None, "code": "no_replica_available"}}
    assert chunks[3:] == ["[DONE]"]


STALL_S = 60.0  # a replica stuck mid-request: far past every deadline the tests give


class SkippingClock:
    """``time.monotonic`` for deadlines.py: the real one, plus the time ``skip`` jumped."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skipped

    def skip(self, seconds: float) -> None:
        self.skipped += seconds


class SlowCluster(FakeCluster):
    """20 tokens: three at once, then a stall of ``stall_s`` (a replica stuck), then the other
    17; ``sent`` counts the tokens it gave. Only a deadline ends a request in the stall.
    ``clock``: deadlines.py's (patched in), moved on by the stall as the third token goes out,
    so the deadline passes in the stall however slow the machine is."""

    def __init__(self, stall_s: float = STALL_S, clock: SkippingClock | None = None) -> None:
        super().__init__()
        self.stall_s, self.clock, self.sent = stall_s, clock, 0

    async def generate(self, prompt_ids, params, request_id):
        self.started.append(request_id)
        try:
            for step in range(20):
                await asyncio.sleep(0)
                if step == 3:
                    await asyncio.sleep(self.stall_s)
                elif step == 2 and self.clock is not None:
                    self.clock.skip(self.stall_s)
                done = step == 19
                self.sent += 1
                yield RequestOutput(request_id, None, prompt_ids, [CompletionOutput(
                    0, list(range(step + 1)), "x" * (step + 1), "length" if done else None)],
                    RequestMetrics(0.0), finished=done)
        finally:
            self.closed.append(request_id)


DEADLINE = {"message": "The request did not finish within its deadline (X-Request-Timeout, or "
            "the server's request_timeout) and was stopped.", "type": "timeout_error",
            "param": None, "code": "deadline_exceeded"}


def test_a_request_past_its_deadline_is_stopped_with_a_504_and_aborted():
    cluster = SlowCluster()
    response = post(cluster, {"prompt": [1]}, headers={"X-Request-Timeout": "0.35"})
    assert (response.status_code, response.json()) == (504, {"error": DEADLINE})
    assert cluster.closed == cluster.started  # aborted on its replica
    assert cluster.sent <= 3  # stopped in the stall, at its deadline: not at the next token
    # the server's own limit, with no header
    assert post(SlowCluster(), {"prompt": [1]}, request_timeout=0.35).status_code == 504
    # a header asks for longer than the server allows: the server's limit holds
    assert post(SlowCluster(), {"prompt": [1]}, headers={"X-Request-Timeout": "60"},
                request_timeout=0.35).status_code == 504
    # a deadline it meets: the whole output (a short stall, then the rest)
    assert post(SlowCluster(stall_s=0.1), {"prompt": [1]}, headers={
        "X-Request-Timeout": "60"}).json()["choices"][0]["text"] == "x" * 20


def test_a_stream_past_its_deadline_ends_with_the_504_as_an_event(monkeypatch):
    clock = SkippingClock()
    monkeypatch.setattr(deadlines, "time", clock)
    cluster = SlowCluster(clock=clock)
    # a deadline no machine misses before the stall: the three tokens stream first
    response = post(cluster, {"prompt": [1], "stream": True},
                    headers={"X-Request-Timeout": "30"})
    chunks = events(response.text)
    assert response.status_code == 200 and len(chunks) - 2 == 3
    assert chunks[-2:] == [{"error": DEADLINE}, "[DONE]"]
    assert cluster.closed == cluster.started and cluster.sent == 3


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_bad_deadline_header_is_a_400(value):
    cluster = SlowCluster()
    response = post(cluster, {"prompt": [1]}, headers={"X-Request-Timeout": value})
    assert response.status_code == 400 and cluster.started == []
    assert response.json()["error"] == {
        "message": f"The X-Request-Timeout header must be a positive number of seconds, got "
                   f"{value!r}.", "type": "invalid_request_error", "param": None,
        "code": "invalid_header"}
