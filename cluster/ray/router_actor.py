"""The cluster's router: one actor that tracks replica load and applies the placement policy."""

from collections.abc import Sequence

from router.placement import LeastLoaded, PlacementPolicy

# The router keeps only in-flight counts, which rebuild themselves as requests come and go,
# so Ray may restart it freely.
ROUTER_ACTOR_OPTIONS = {"max_restarts": -1, "num_cpus": 0}


class RouterActor:
    def __init__(self, num_replicas: int, policy: PlacementPolicy | None = None) -> None:
        self.policy = policy or LeastLoaded()
        self.loads = [0] * num_replicas
        self.placed: dict[str, int] = {}

    def assign(self, request_id: str, token_ids: Sequence[int]) -> int:
        replica = self.policy.choose(self.loads, token_ids)
        self.loads[replica] += 1
        self.placed[request_id] = replica
        return replica

    def release(self, request_id: str) -> None:
        replica = self.placed.pop(request_id, None)
        if replica is not None:
            self.loads[replica] -= 1

    def get_loads(self) -> list[int]:
        return list(self.loads)
