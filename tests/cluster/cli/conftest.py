"""One `tandem serve` subprocess, started as a user starts it, shared by the tests that need a
running server (its health with vLLM's flags, `tandem bench serve --base-url`, guidellm); the
last of them (test_serve_command.py) stops it with SIGTERM and checks that it drains."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx2 as httpx
import pytest

SERVED_MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServedProcess:
    url: str
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)  # its output so far (read all along, so
    # a full pipe never blocks it)

    def read_output(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)


@pytest.fixture(scope="session")
def served() -> Iterator[ServedProcess]:
    """`tandem serve` run with the brief's command line (on the CPU)."""
    port = free_port()
    command = [sys.executable, "-m", "cluster.cli.main", "serve", SERVED_MODEL,
               "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
               "--enable-chunked-prefill", "--max-model-len", "2048",
               "--tensor-parallel-size", "1", "--scheduler-delay-factor", "0.5",
               "--device", "cpu", "--port", str(port)]
    # its own Ray instance, not the test session's
    env = dict(os.environ, RAY_ADDRESS="local")
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    server = ServedProcess(f"http://127.0.0.1:{port}", process)
    threading.Thread(target=server.read_output, daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, server.output
            assert time.monotonic() < deadline, "the server did not come up"
            try:  # up, and done loading: it printed where it serves
                if (httpx.get(f"{server.url}/health", timeout=2).status_code == 200
                        and "tandem is serving" in server.output):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            raise


@pytest.fixture
def served_url(served: ServedProcess) -> str:
    assert served.process.poll() is None, ("the shared `tandem serve` has stopped: the SIGTERM "
                                           "test runs last of the tests that use it")
    return served.url
