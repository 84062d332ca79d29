"""One `tandem serve` subprocess, started as a user starts it, shared by the tests that need a
running server (its health with vLLM's flags, `tandem bench serve --base-url`, guidellm)."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

SERVED_MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def served_url() -> Iterator[str]:
    """The base URL of `tandem serve` run with the brief's command line (on the CPU)."""
    port = free_port()
    command = [sys.executable, "-m", "cluster.cli.main", "serve", SERVED_MODEL,
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
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
