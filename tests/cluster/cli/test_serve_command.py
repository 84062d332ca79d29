"""`tandem serve` as a user runs it, with vLLM's flags: it comes up healthy and answers."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_with_the_brief_s_flags_comes_up_healthy():
    port = free_port()
    command = [sys.executable, "-m", "cluster.cli.main", "serve", "smollm2-135m-instruct",
               "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
               "--enable-chunked-prefill", "--max-model-len", "2048",
               "--tensor-parallel-size", "1", "--scheduler-delay-factor", "0.5",
               "--device", "cpu", "--port", str(port)]
    # its own Ray instance, not the test session's
    env = dict(os.environ, RAY_ADDRESS="local")
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "smollm2-135m-instruct", "prompt": "The capital of France is",
            "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
