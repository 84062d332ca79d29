"""Ports for the servers the tests start, chosen below the kernel's ephemeral range (Linux:
32768-60999). A port chosen there with ``bind(0)`` can be taken by any outgoing connection's
socket before its server binds it: `tandem serve` binds its ingress minutes after it starts on
a busy machine, and its deploy then failed with Serve's NoAvailablePortError. A port below
that range stays free until a server binds it."""

import os
import random
import socket
import time

FIRST, LAST = 20000, 32000


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive ports that are free now."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())  # two workers choose apart
    for _ in range(1000):
        first = rng.randrange(FIRST, LAST - count)
        if all(is_free(port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} free consecutive ports in {FIRST}-{LAST}")


def is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
