"""`tandem serve` as a user runs it, with vLLM's flags: it comes up healthy and answers, on the
port it printed; SIGTERM drains it."""

import json
import signal
import threading
import time

import httpx2 as httpx
import pytest

from tests.cluster.cli.conftest import SERVED_MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_serve_with_the_brief_s_flags_comes_up_healthy(served_url):
    response = httpx.post(f"{served_url}/v1/completions", timeout=60, json={
        "model": SERVED_MODEL, "prompt": "The capital of France is",
        "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


def test_the_printed_url_is_the_ingress_replica_s_own_port(served):
    # one ingress replica on the CPU: it listens on --port itself (direct ingress), and that is
    # what is printed; Serve's proxy is on the next port
    port = int(served.url.rsplit(":", 1)[1])
    assert f"tandem is serving {SERVED_MODEL} at {served.url}/v1" in served.output
    assert httpx.get(f"http://127.0.0.1:{port + 1}/health", timeout=10).status_code == 200


def test_sigterm_drains_the_requests_in_flight_then_exits_promptly(served):
    """The last test of the shared server: it stops it."""
    tokens = 48
    chunks: list[dict] = []
    first = threading.Event()

    def stream():
        body = {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": tokens,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    served.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    # from the moment the drain starts: /health says so, new requests get 503 at once
    while True:
        health = httpx.get(f"{served.url}/health", timeout=10)
        if health.status_code == 503:
            break
        assert time.monotonic() - signalled < 10, "the drain did not start"
        time.sleep(0.05)
    assert health.json()["error"]["code"] == "draining"
    refused = httpx.post(f"{served.url}/v1/completions", timeout=10, json={
        "model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 2})
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "2")
    assert refused.json()["error"]["code"] == "draining"
    reader.join(60)
    # the stream in flight finished whole
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["usage"]["completion_tokens"] == tokens
    assert [c["choices"][0].get("finish_reason") for c in chunks[:-2]][-1] == "length"
    assert served.process.wait(timeout=60) == 0
    took = time.monotonic() - signalled
    assert took < 30, took  # it was ~33 s before, with nothing in flight
    assert "tandem: drained in" in served.output
    assert "failed to shut down" not in served.output
