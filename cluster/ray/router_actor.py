"""The cluster's router: one async actor over a ``ReplicaRouter`` (router/replica_router.py).

Replicas push their KV event batches here after each step, without waiting; the answer to a
batch says whether the directory needs that replica's cache dump (after a gap), which the
replica then sends. The router never calls a replica: the health monitor tells it which are
up (replica_monitor.py), ingresses tell it which requests moved after a loss.
"""

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import ray

from kvstore.block_hash import BlockHash
from kvstore.directory import CacheDump, EventBatch
from router.admission import AdmissionLimits, Refusal
from router.kv_pricing import TransferRates
from router.placement import Decision
from router.replica_router import ClusterHealth, ReplicaRouter, RouterStats

# A restarted router starts with an empty directory and no loads: both rebuild themselves (the
# replicas' next batches show it gaps, so each sends its dump), so Ray may restart it freely.
ROUTER_ACTOR_OPTIONS = {"max_restarts": -1, "num_cpus": 0}
NAME_PREFIX = "tandem-router:"


@dataclass(frozen=True)
class RouterAddress:
    """The router by name, as an actor that Ray may restart finds it. Ray gives a restarted
    actor its constructor's arguments again, but an actor handle among them is a reference it
    does not keep for that (it says so at every start, ray-project/ray#53727); a name is looked
    up anew by each process."""

    name: str
    namespace: str

    @classmethod
    def new(cls, group: str = "") -> "RouterAddress":
        """A name of its own in the caller's namespace; ``group`` (a Serve app's name) lets
        ``find_routers`` find every router of that group."""
        return cls(f"{NAME_PREFIX}{group}:{uuid.uuid4().hex[:12]}",
                   ray.get_runtime_context().namespace)

    def lookup(self) -> object:
        return ray.get_actor(self.name, namespace=self.namespace)


def find_routers(group: str) -> list[RouterAddress]:
    """The routers alive now of every cluster started with ``group``, in any namespace."""
    prefix = f"{NAME_PREFIX}{group}:"
    return [RouterAddress(actor["name"], actor["namespace"])
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith(prefix)]


class RouterActor:
    def __init__(self, num_replicas: int, policy: str = "prefix-affinity",
                 limits: AdmissionLimits | None = None) -> None:
        self.router = ReplicaRouter(num_replicas, policy, limits=limits)
        self.handles: dict[int, object] = {}  # replica index -> actor handle (sync_replicas)

    async def assign(self, request_id: str, block_hashes: Sequence[BlockHash],
                     num_prompt_tokens: int, block_size: int, exclude: Sequence[int] = (),
                     resumed: bool = False) -> Decision | Refusal:
        """The replica (and any blocks it pulls first), or why none takes it (a value, not an
        exception: refusals are routine under overload and cost no traceback here)."""
        return self.router.assign(request_id, block_hashes, num_prompt_tokens, block_size,
                                  exclude, resumed)

    async def set_rates(self, rates: TransferRates | None) -> None:
        self.router.set_rates(rates)

    async def time_fetch(self, refs: list) -> float:
        """Seconds to fetch ``refs[0]`` from the object store (kv_pull.py's probe)."""
        started = time.perf_counter()
        await refs[0]
        return time.perf_counter() - started

    async def lost(self, request_id: str, replica: int, process_died: bool) -> None:
        self.router.lost(request_id, replica, process_died)

    async def set_health(self, alive: list[bool]) -> None:
        self.router.set_health(alive)

    async def health(self) -> ClusterHealth:
        return self.router.health()

    async def drain_all(self) -> int:
        return self.router.drain_all()

    async def num_in_flight(self) -> int:
        return self.router.num_in_flight

    async def first_token(self, request_id: str) -> None:
        self.router.first_token(request_id)

    async def release(self, request_id: str) -> None:
        self.router.release(request_id)

    async def report_events(self, batch: EventBatch) -> bool:
        """True when the directory needs the replica's cache dump (it then sends ``resync``)."""
        return self.router.report(batch)

    async def resync(self, dump: CacheDump) -> bool:
        """True when the batches that came meanwhile still leave a gap: send another dump."""
        return self.router.resync(dump)

    async def replica_down(self, replica: int) -> None:
        self.router.replica_down(replica)

    async def replica_up(self, replica: int) -> None:
        self.router.replica_up(replica)

    async def stats(self) -> RouterStats:
        return self.router.stats()

    async def get_loads(self) -> list[int]:
        return [load.num_requests for load in self.router.loads()]

    # Replicas the autoscaler (cluster/ray/autoscaler.py) adds and removes while the cluster
    # runs. Their handles are kept here, where every ingress process can find them.

    async def add_replica(self) -> int:
        """A slot for a replica about to start; nothing goes there until it reports up."""
        return self.router.add_replica()

    async def sync_replicas(self, handles: dict[int, object]) -> None:
        """The cluster's replicas by index, from their owner (at start and each autoscaler
        sample): a router restarted meanwhile gets its slots back this way."""
        self.router.restore(sorted(handles))
        self.handles = dict(handles)

    async def replica_handles(self) -> dict[int, object]:
        return dict(self.handles)

    async def drain(self, replica: int) -> None:
        self.router.drain(replica)

    async def remove_replica(self, replica: int) -> None:
        self.router.remove(replica)
        self.handles.pop(replica, None)
