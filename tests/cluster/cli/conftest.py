"""One `tandem serve` subprocess, started as a user starts it, shared by the tests that need a
running server (its health with vLLM's flags, `tandem bench serve --base-url`, guidellm); the
last of them (test_serve_command.py) stops it with SIGTERM and checks that it drains."""

import signal
import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster.cli.served_process import EARLY, SERVED_MODEL, ServedProcess

__all__ = ["SERVED_MODEL"]


@pytest.fixture(scope="session")
def served() -> Iterator[ServedProcess]:
    """`tandem serve` run with the brief's command line (on the CPU), started as the
    collection ended (served_process.py)."""
    server = EARLY.take()
    process = server.process
    try:
        server.wait_until_serving(timeout_s=240)
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
