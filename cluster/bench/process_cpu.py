"""CPU time of this machine's processes, from /proc (Linux): where a benchmark's cores went.

``CpuMeter`` takes every process's user + system time at the start of a load and again at its
end; the difference over the wall time is each process's share of a core. Ray names its
worker processes ``ray::<Actor>`` (``ray::<Actor>.<method>`` while a call runs), so the
replica, its shards, the ingress replicas and Serve's proxy can be told apart.
"""

import os
import time
from collections import defaultdict
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def process_name(pid: int) -> str:
    """``ray::ReplicaActor`` for a Ray worker (the actor, not the call it runs), else argv[0]'s
    file name, else (a kernel thread) the kernel's name for it."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        name = argv[0].decode(errors="replace")
        if not name:
            return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "?"
    return name.split(".", 1)[0] if name.startswith("ray::") else Path(name).name


def all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


class CpuMeter:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.before = {pid: cpu_seconds(pid) for pid in all_pids()}

    def shares(self, top: int = 12) -> dict[str, float]:
        """Cores used since the start by process name (processes of one name added up, e.g.
        four ingress replicas), the busiest ``top`` names."""
        seconds = time.perf_counter() - self.start
        used: dict[str, float] = defaultdict(float)
        for pid in all_pids():
            now = cpu_seconds(pid)
            if now is None:
                continue
            delta = now - (self.before.get(pid) or 0.0)
            if delta > 0:
                used[f"{process_name(pid)}"] += delta / seconds
        busiest = sorted(used.items(), key=lambda item: -item[1])[:top]
        return {name: round(share, 3) for name, share in busiest}
