"""Ray nodes made of this machine's processes, for a scenario that needs more than the test
session's one Ray instance: a head (`ray start --head --block`), with or without Ray's fake
autoscaler, and more nodes (`ray start --address --block`).

Ray's own helper for the first, ``ray.cluster_utils.AutoscalingCluster``, cannot be used as it
stands: its ``start`` runs ``ray stop --force``, which kills every Ray process of the machine
(other test sessions' too), and the base config it reads (``fake_multi_node/example.yaml``)
is missing from Ray 2.60's wheel. This does what it does — the same fake node provider
(``RAY_FAKE_CLUSTER=1``, ``type: fake_multinode``), whose "nodes" are raylets the autoscaler
starts on this machine — with a port and a temp dir of its own, and stops only the processes
it started, by their ids.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray

# Token auth would need the same token in every process; these nodes listen on this machine
# only for the few seconds of a test. A drain on SIGTERM would only slow the stop down. A node
# (or driver) started with the head waits for its GCS longer than Ray's 20 s: on a busy
# machine the head takes longer than that to come up.
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
       "RAY_USAGE_STATS_ENABLED": "0", "RAY_gcs_server_port_wait_time_s": "180"}
AUTOSCALER_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def fake_autoscaling_config(head_cpus: int, worker_types: dict, gcs_address: str,
                            idle_timeout_s: float) -> dict:
    """A cluster config for Ray's fake multi-node provider: AutoscalingCluster's, written out.
    ``worker_types``: name -> {"resources", "min_workers", "max_workers"}."""
    types = {name: {"node_config": {}, **spec} for name, spec in worker_types.items()}
    types["ray.head.default"] = {"resources": {"CPU": head_cpus}, "node_config": {},
                                 "max_workers": 0}
    return {
        "cluster_name": "tandem-test", "max_workers": sum(t.get("max_workers", 0)
                                                         for t in worker_types.values()),
        # the provider's nodes join this head, not one at the default port 6379
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs_address},
        "available_node_types": types, "head_node_type": "ray.head.default",
        "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60,
        "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        **{key: [] for key in ("initialization_commands", "setup_commands",
                               "head_setup_commands", "worker_setup_commands",
                               "head_start_ray_commands", "worker_start_ray_commands")},
    }


class LocalNodes:
    """``start_head`` first, then ``add_node`` for each more (they need not wait for the head:
    they join it once it is up); ``stop`` at the end. A driver joins with ``connect``."""

    def __init__(self) -> None:
        # short: Ray's socket paths under it must stay within the OS's 107 characters
        self.temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
        self.port = free_port()
        # the address the fake provider's nodes take for themselves too
        self.ip = ray._private.services.get_node_ip_address()
        self.address = f"{self.ip}:{self.port}"
        self.processes: list[subprocess.Popen] = []

    def _ray_start(self, args: list[str], env: dict[str, str], log_name: str) -> None:
        environ = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        log = open(Path(self.temp_dir) / log_name, "w")  # noqa: SIM115 - kept with the process
        self.processes.append(subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
             "--disable-usage-stats", *args], env={**environ, **ENV, **env}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True))

    def start_head(self, num_cpus: int, worker_types: dict | None = None,
                   idle_timeout_s: float = 3.0) -> str:
        """The head, and Ray's autoscaler over ``worker_types`` when given; its address."""
        args = ["--head", f"--port={self.port}", f"--node-ip-address={self.ip}",
                f"--num-cpus={num_cpus}", f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false"]
        env: dict[str, str] = {}
        if worker_types:
            path = Path(self.temp_dir) / "autoscaling.json"
            path.write_text(json.dumps(fake_autoscaling_config(
                num_cpus, worker_types, self.address, idle_timeout_s)))
            args.append(f"--autoscaling-config={path}")
            env = AUTOSCALER_ENV
        self._ray_start(args, env, "head.log")
        return self.address

    def add_node(self, num_cpus: int, resources: dict[str, float]) -> None:
        self._ray_start([f"--address={self.address}", f"--node-ip-address={self.ip}",
                         f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources)}"],
                        {}, f"node-{len(self.processes)}.log")

    def connect(self) -> None:
        """This process as a driver of the cluster, once its head is up."""
        os.environ.update(ENV)
        ray.init(address=self.address, log_to_driver=False)

    def log_tail(self, num_lines: int = 25) -> str:
        """What a failed scenario needs to be read: the last lines of the autoscaler's log and
        the warnings and errors of the raylets and the GCS (before ``stop`` removes them)."""
        logs = sorted(Path(self.temp_dir).glob("session_*/logs"))
        if not logs:
            return "(no Ray logs)"
        parts = []
        for path in sorted(logs[-1].glob("monitor.log")) + sorted(logs[-1].glob("raylet*.out")) \
                + sorted(logs[-1].glob("gcs_server.out")):
            lines = path.read_text(errors="replace").splitlines()
            if path.name != "monitor.log":  # only what went wrong
                lines = [line for line in lines if " E " in line or " W " in line]
            parts.append(f"== {path.name}\n" + "\n".join(lines[-num_lines:]))
        return "\n".join(parts)

    def _leftovers(self) -> list[int]:
        """Processes still running in this cluster's temp dir: a node the fake autoscaler had
        started and not yet returned, or one that outlived its ``ray start``."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue  # gone already
            if self.temp_dir.encode() in command:
                pids.append(int(entry.name))
        return pids

    def stop(self, timeout_s: float = 20.0) -> None:
        """Each ``ray start --block`` stops its node's processes on SIGTERM; the rest (nodes
        the autoscaler started) by their ids."""
        for process in reversed(self.processes):  # the head last
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
        for pid in self._leftovers():
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.2):
    """The condition's first true value, or an error naming what did not happen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)
