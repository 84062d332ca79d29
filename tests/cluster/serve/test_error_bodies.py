"""A failing server tells the client what went wrong in its own words and a reference, never
the exception's text (tracebacks, paths, ANSI colours, PIDs, actor ids, node addresses); the
exception goes to the log under that reference. Over a fake cluster that raises as Ray does."""

import asyncio
import logging
import re

import httpx2 as httpx
import pytest
import ray

from cluster.engine.outputs import RequestFailed
from cluster.ray.replica import ReplicaFailure
from cluster.serve.app import build_app
from cluster.serve.config import ServeConfig
from cluster.serve.openai_service import OpenAIService
from tests.cluster.serve.test_protocol import FakeCluster, events, run

TRACEBACK = ('Traceback (most recent call last):\n  File "/work/main/cluster/ray/replica.py", '
             'line 99, in submit\n    engine.add_request(prompt_ids, params, request_id)\n')
# what no error body may hold: a traceback, a file path, ANSI colours, a PID, an address, an id
INSIDES = ["Traceback", 'File "', "/work/", "\x1b[", "pid=", "4242", "10.1.2.3", "actor_id",
           "abcdef0123", "ReplicaActor", "RuntimeError"]


def ray_task_error(cause: Exception) -> Exception:
    """``cause`` as a Ray actor method raises it in the caller: its text has it all."""
    return ray.exceptions.RayTaskError(
        "ReplicaActor.submit", TRACEBACK + f"{type(cause).__name__}: {cause}", cause,
        proctitle="ray::ReplicaActor.submit", pid=4242, ip="10.1.2.3",
        actor_repr="ReplicaActor", actor_id="abcdef0123").as_instanceof_cause()


class FailingCluster(FakeCluster):
    """Raises ``error`` when a request starts, or after ``after`` outputs of it."""

    def __init__(self, error: BaseException, after: int = 0) -> None:
        super().__init__()
        self.error, self.after = error, after

    async def generate(self, prompt_ids, params, request_id):
        sent = 0
        async for output in super().generate(prompt_ids, params, request_id):
            if sent == self.after:
                raise self.error
            await asyncio.sleep(0)
            yield output
            sent += 1


def post(cluster: FakeCluster, body: dict) -> httpx.Response:
    async def go():
        settings = ServeConfig(model="fake", api_key=None)
        app = build_app(OpenAIService(cluster, None, "fake"), settings)
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    return run(go())


# a response id and an error reference are random hex, which may hold "4242" by chance
RANDOM_HEX = re.compile(r'"id":"[a-z]+-[0-9a-f]+"|error reference [0-9a-f]{12}')


def assert_no_insides(text: str) -> None:
    text = RANDOM_HEX.sub("", text)
    for inside in INSIDES:
        assert inside not in text, (inside, text)


def reference_in(message: str) -> str:
    [reference] = re.findall(r"error reference ([0-9a-f]{12})", message)
    return reference


def logged_with(caplog, reference: str) -> logging.LogRecord:
    [record] = [r for r in caplog.records if reference in r.getMessage()]
    return record


def test_a_server_failure_is_a_500_that_shows_nothing_inside(caplog):
    error = ray_task_error(RuntimeError("CUDA error at /usr/lib/libcuda.so"))
    with caplog.at_level(logging.ERROR, logger="cluster.serve.failures"):
        response = post(FailingCluster(error), {"prompt": [1]})
    assert response.status_code == 500
    body = response.json()["error"]
    reference = reference_in(body["message"])
    assert body == {"message": f"The server failed while running this request (error reference "
                               f"{reference}); its log has the details.",
                    "type": "server_error", "param": None, "code": "internal_error"}
    assert_no_insides(response.text)
    # the whole exception, traceback and all, is in the log under the body's reference
    record = logged_with(caplog, reference)
    assert record.exc_info[1] is error and "libcuda.so" in str(record.exc_info[1])


def test_a_failure_mid_stream_is_an_error_event_that_shows_nothing_inside(caplog):
    error = ray_task_error(RuntimeError("segfault in /srv/kernel.cu"))
    with caplog.at_level(logging.ERROR, logger="cluster.serve.failures"):
        response = post(FailingCluster(error, after=2), {"prompt": [1], "stream": True})
    assert response.status_code == 200
    chunks = events(response.text)
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["He", "ll"]
    assert chunks[-1] == "[DONE]"
    message = chunks[2]["error"]["message"]
    assert message == (f"The server failed while running this request (error reference "
                       f"{reference_in(message)}); its log has the details.")
    assert_no_insides(response.text)
    assert logged_with(caplog, reference_in(message)).exc_info[1] is error


@pytest.mark.parametrize("error", [
    ReplicaFailure("replica 0 lost a shard and is rebuilding: a shard actor failed: "
                   "\x1b[36mray::ShardActor.__ray_call__()\x1b[39m (pid=4242, ip=10.1.2.3)"),
    ray.exceptions.ActorDiedError(),
    ray.exceptions.ActorUnavailableError("actor abcdef0123 at 10.1.2.3 is restarting", None),
])
def test_a_lost_replica_is_a_503_that_shows_nothing_inside(error):
    response = post(FailingCluster(error), {"prompt": [1]})
    assert (response.status_code, response.headers["retry-after"]) == (503, "5")
    body = response.json()["error"]
    assert body["message"] == ("The engine replica running this request failed and is being "
                               "restarted: retry the request (error reference "
                               f"{reference_in(body['message'])}).")
    assert (body["type"], body["code"]) == ("service_unavailable", "replica_failed")
    assert_no_insides(response.text)


def test_a_request_the_engine_failed_says_so_in_the_engine_s_words():
    error = RequestFailed("the engine failed request cmpl-1 while turning its tokens into text "
                          "(KeyError); other requests were not affected")
    response = post(FailingCluster(error, after=1), {"prompt": [1]})
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert message == (f"{error} (error reference {reference_in(message)})")
    assert response.json()["error"]["code"] == "request_failed"


def test_a_prompt_the_engine_refused_is_a_400_in_its_own_words():
    """The engine's prompt checks raise ValueError inside the replica actor: the caller gets
    them wrapped in a RayTaskError, whose text is the traceback; the body has the message."""
    error = ray_task_error(ValueError("token id 70000 is out of range for a vocabulary of 49152"))
    response = post(FailingCluster(error), {"prompt": [70000]})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "token id 70000 is out of range for a vocabulary of 49152",
        "type": "invalid_request_error", "param": "prompt", "code": "invalid_prompt"}


def test_a_value_error_that_is_not_ours_is_a_server_failure():
    # several lines: not a message our checks write (a library's, with its insides)
    error = ValueError("bad shape\n  at /srv/model.py:12")
    response = post(FailingCluster(error), {"prompt": [1]})
    assert response.status_code == 500
    assert_no_insides(response.text)
    assert "/srv" not in response.text


def test_health_does_not_send_the_replica_s_reason(caplog):
    class DeadCluster(FakeCluster):  # its router cannot be reached
        async def health(self):
            raise ReplicaFailure("replica 1 could not rebuild: OSError at /dev/nvidia0, pid 4242")

    async def go():
        app = build_app(OpenAIService(DeadCluster(), None, "fake"), ServeConfig(api_key=None))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://test") as client:
            return await client.get("/health")

    with caplog.at_level(logging.WARNING, logger="cluster.serve.failures"):
        response = run(go())
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert message == ("The engine is not ready: a replica is down or restarting (error "
                       f"reference {reference_in(message)}).")
    assert response.json()["error"]["code"] == "not_ready"
    assert "/dev/nvidia0" in logged_with(caplog, reference_in(message)).getMessage()


def test_an_exception_outside_the_cluster_is_a_500_that_shows_nothing_inside():
    class BrokenTokenizer:
        def encode(self, text):
            raise OSError("[Errno 5] read /root/.cache/tandem/models/x/tokenizer.json, pid 4242")

    async def go():
        app = build_app(OpenAIService(FakeCluster(), BrokenTokenizer(), "fake"),
                        ServeConfig(api_key=None))
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json={"prompt": "hi"})

    response = run(go())
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith(
        "The server failed while running this request (error reference ")
    assert_no_insides(response.text)
    assert "tokenizer.json" not in response.text
