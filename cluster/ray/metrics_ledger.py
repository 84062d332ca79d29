"""Each replica's counters across the processes it has had, so /metrics never goes backwards.

A replica keeps its counts across engine rebuilds itself; when its process dies, Ray starts a
new one that counts from zero. The ledger keeps, per replica, the last snapshot of each
process (by its incarnation) and adds the finished processes' counts to the live one's. What
a dead process counted after its last snapshot here (at most one health-check period) is
lost; nothing already shown is ever taken back.
"""

from dataclasses import dataclass, field

from cluster.engine.metrics import MetricsSnapshot, cumulative, empty_snapshot, idle
from cluster.ray.heartbeat import Heartbeat


@dataclass
class ReplicaLedger:
    retired: MetricsSnapshot = field(default_factory=empty_snapshot)  # earlier processes'
    incarnation: str | None = None
    seq: int = -1
    last: MetricsSnapshot = field(default_factory=empty_snapshot)
    gone: set[str] = field(default_factory=set)  # incarnations already retired


class MetricsLedger:
    def __init__(self, num_replicas: int) -> None:
        self.replicas = [ReplicaLedger() for _ in range(num_replicas)]

    def record(self, replica: int, beat: Heartbeat) -> None:
        entry = self.replicas[replica]
        if beat.incarnation in entry.gone:  # a dead process's answer, arriving late
            return
        if beat.incarnation != entry.incarnation:
            if entry.incarnation is not None:
                entry.retired = idle(cumulative(entry.retired, entry.last))
                entry.gone.add(entry.incarnation)
            entry.incarnation, entry.seq, entry.last = beat.incarnation, beat.seq, beat.metrics
        elif beat.seq > entry.seq:  # an older snapshot that arrives late changes nothing
            entry.seq, entry.last = beat.seq, beat.metrics

    def totals(self, reachable: list[bool]) -> list[MetricsSnapshot]:
        """Every replica's counts so far; the gauges of those that answered just now (one that
        did not runs nothing we can see)."""
        return [cumulative(entry.retired, entry.last if up else idle(entry.last))
                for entry, up in zip(self.replicas, reachable, strict=True)]
