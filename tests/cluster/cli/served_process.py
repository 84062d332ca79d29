"""One `tandem serve` subprocess, started as a user starts it (its own Ray instance), shared by
the tests that need a running server. It starts as the session's collection ends, so that its
start-up (Ray, Serve, the default model) runs beside the tests collected before it; the
`served` fixture (conftest.py) waits until it serves."""

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

SERVED_MODEL = "smollm2-135m-instruct"
FIXTURE = "served"  # the tests that ask for it make the collection hook start it


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

    def wait_until_serving(self, timeout_s: float) -> None:
        import httpx2 as httpx  # here: the conftest imports this module where no httpx is

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, self.output
            assert time.monotonic() < deadline, "the server did not come up"
            try:  # up, and done loading: it printed where it serves
                if (httpx.get(f"{self.url}/health", timeout=2).status_code == 200
                        and "tandem is serving" in self.output):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)


def start_served() -> ServedProcess:
    """`tandem serve` run with the brief's command line (on the CPU)."""
    port = free_port()
    command = [sys.executable, "-m", "cluster.cli.main", "serve", SERVED_MODEL,
               "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
               "--enable-chunked-prefill", "--max-model-len", "2048",
               "--tensor-parallel-size", "1", "--scheduler-delay-factor", "0.5",
               "--device", "cpu", "--port", str(port)]
    # its own Ray instance, not the test session's
    process = subprocess.Popen(command, env=dict(os.environ, RAY_ADDRESS="local"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = ServedProcess(f"http://127.0.0.1:{port}", process)
    threading.Thread(target=server.read_output, daemon=True).start()
    return server


class EarlyStart:
    """The server the collection hook started, taken by the fixture (or started by it)."""

    def __init__(self) -> None:
        self.server: ServedProcess | None = None

    def start(self) -> None:
        self.server = start_served()

    def take(self) -> ServedProcess:
        server, self.server = self.server, None
        return server or start_served()

    def stop(self) -> None:
        """A server no test took (the session ended before them)."""
        if self.server is not None and self.server.process.poll() is None:
            self.server.process.kill()


EARLY = EarlyStart()
