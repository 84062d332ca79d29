"""What a replica answers the health monitor each period: whether it can serve, and its
figures so far."""

from dataclasses import dataclass

from cluster.engine.metrics import MetricsSnapshot


@dataclass(frozen=True)
class Heartbeat:
    # made when the replica actor's process starts: a new one means Ray restarted it, and
    # whatever it counted before is gone from it (the monitor's ledger keeps it)
    incarnation: str
    seq: int  # increases with every snapshot one incarnation takes: the later one wins
    metrics: MetricsSnapshot  # counters since the process started, across engine rebuilds
    problem: str | None = None  # None when the engine and every shard answer; else why not
