"""How a cluster meets overload and faults: one frozen object, from `tandem serve` flags or a
Serve config file, handed to the router, the health monitor and every ingress's view."""

from dataclasses import dataclass

from router.admission import AdmissionLimits


@dataclass(frozen=True)
class ServingPolicy:
    max_waiting_requests: int = 0  # per replica, requests without a first token; 0: no limit
    max_waiting_tokens: int = 0  # per replica, their prompt tokens; 0: no limit
    retry_after_s: int = 2  # what a 503 asks the client to wait (its Retry-After header)
    # after a loss, how long a request keeps looking for a replica that takes its continuation
    failover_timeout_s: float = 30.0
    health_check_period_s: float = 1.0  # every replica and its shards are pinged this often
    health_check_timeout_s: float = 10.0  # a ping not answered in this long counts as down
    # a replica not up this long after it started (no node for its shards, a shard stuck)
    # fails with ReplicaStartTimeout instead of hanging (cluster/ray/replica_start.py)
    replica_start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be at least 1, got {self.retry_after_s}")
        for name in ("failover_timeout_s", "health_check_period_s", "health_check_timeout_s",
                     "replica_start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def admission(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_waiting_requests, self.max_waiting_tokens)
