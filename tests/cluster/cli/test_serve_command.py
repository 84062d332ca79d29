"""`tandem serve` as a user runs it, with vLLM's flags: it comes up healthy and answers, on the
port it printed, with Ray kept on the loopback address and a log without false alarms; SIGTERM
drains it."""

import ipaddress
import json
import os
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


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def listening_sockets() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this machine: inode -> (address, port)."""
    found = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as rows:
            for row in rows.readlines()[1:]:
                fields = row.split()
                if fields[3] != "0A":  # LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1]
                               for i in range(0, len(address), 8))
                found[int(fields[9])] = (str(ipaddress.ip_address(raw)), int(port, 16))
    return found


def listeners(root: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening socket of ``root``'s process tree."""
    sockets, found = listening_sockets(), []
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                name = comm.read().strip()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # it exited meanwhile
            continue
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in sockets:
                found.append((name, *sockets[int(link[8:-1])]))
    return sorted(set(found))


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # an IPv6 socket's view of 127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_ray_listens_on_the_loopback_address_only(served_url, served):
    """`--host 127.0.0.1` (the default): the Ray instance tandem starts listens on 127.0.0.1
    (GCS, raylet, every worker, the agents, the metrics ports), not on every interface, and
    runs no dashboard. Ray Serve 2.60 binds one socket that no setting moves: each Serve
    replica's inter-deployment gRPC server listens on [::] (ray/serve/_private/replica.py)."""
    found = listeners(served.process.pid)
    assert len(found) > 10  # Ray's processes were seen: the tree is the server's
    port = int(served.url.rsplit(":", 1)[1])
    assert ("ray::ServeRepli", "127.0.0.1", port) in found  # the ingress replica's HTTP
    outside = [(name, address) for name, address, _ in found if not is_loopback(address)]
    # the engines' host and the one ingress replica, Serve's gRPC servers
    assert outside == [("ray::ServeRepli", "::")] * 2, found
    assert not any(port == 8265 for _, _, port in found)  # Ray's dashboard


def test_the_log_raises_no_false_alarm_at_start(served_url, served):
    """No core_worker error about the replicas' constructor arguments (the router was one of
    them: now they find it by name), and Serve's "ready" line names tandem's port, not its
    proxy's."""
    output = served.output
    assert "core_worker.cc" not in output and "constructor arguments" not in output, output
    assert f"Application 'tandem' is ready at {served.url}/." in output
    port = int(served.url.rsplit(":", 1)[1])
    assert f":{port + 1}/" not in output  # Serve's proxy is there; clients are not sent to it


def all_output(served) -> str:
    """The server's output to its end: the fixture's reader thread, joined."""
    for thread in threading.enumerate():
        if getattr(thread, "_target", None) == served.read_output:
            thread.join(timeout=60)
    return served.output


def test_sigterm_drains_the_requests_in_flight_then_exits_cleanly(served):
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
        assert time.monotonic() - signalled < 120, "the drain did not start"
        time.sleep(0.05)
    assert health.json()["error"]["code"] == "draining"
    refused = httpx.post(f"{served.url}/v1/completions", timeout=10, json={
        "model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 2})
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "2")
    assert refused.json()["error"]["code"] == "draining"
    reader.join(120)
    # the stream in flight finished whole
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["usage"]["completion_tokens"] == tokens
    assert [c["choices"][0].get("finish_reason") for c in chunks[:-2]][-1] == "length"
    # generous: on a busy machine the exit takes what it takes
    assert served.process.wait(timeout=180) == 0
    output = all_output(served)
    assert "tandem: drained in" in output
    # nothing on its way out waited for a timeout (the exit took ~33 s, with nothing in
    # flight, before Serve was shut down with a call Ray does not retry: drain.py's
    # stop_serve), nor failed and was retried (the lines below)
    assert "failed to shut down" not in output and "did not shut down within" not in output
    # Serve shut down without "Task ServeController.graceful_shutdown failed" (its own
    # shutdown call, retried for ever) nor "... listen_for_change failed" (a Serve handle in
    # the drain): nothing failed
    assert "Task ServeController" not in output and "retries remaining" not in output, output
