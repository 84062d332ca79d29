"""A model served by several replicas on a Ray cluster, behind one router.

    cluster = TandemCluster(EngineConfig(model="smollm2-135m-instruct"), num_replicas=2)
    async for output in cluster.generate(prompt_ids, SamplingParams(max_tokens=32), "req-1"):
        print(output.text)

Each replica is a ``ReplicaActor`` with its own tensor-parallel shard actors; the
``RouterActor`` picks the replica for each request from the prompt's block hashes (computed
here, with the engines' block size and extra keys) and the replicas' loads, or refuses it when
every queue is full (``Overloaded``) or the server drains (``Draining``). With host KV tiers,
it may also pick a replica that first pulls the prefix from another's host tier (kv_pull.py),
priced from rates measured here at start-up. A request whose
replica is lost continues on another (failover.py); the ``ReplicaMonitor`` pings every replica
and its shards each period, tells the router which are up, and keeps the metrics. Stopping the
iteration early (a client that disconnected) aborts the request on its replica, which frees its
KV blocks at once.
"""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import ray

from cluster.engine.config import EngineConfig
from cluster.engine.metrics import MetricsSnapshot
from cluster.engine.outputs import EngineStats, OutputAccumulator, RequestOutput
from cluster.engine.resume import Resume
from cluster.ray.autoscaler import ReplicaAutoscaler
from cluster.ray.failover import ReplicaLost, process_died, with_failover
from cluster.ray.kv_pull import ExportedBlocks, block_tokens, measure_pull_bandwidth
from cluster.ray.placement import check_placeable, shard_bundle
from cluster.ray.refusals import Draining, Overloaded, Unavailable
from cluster.ray.replica import REPLICA_ACTOR_OPTIONS, ReplicaActor
from cluster.ray.replica_monitor import MONITOR_ACTOR_OPTIONS, ReplicaMonitor
from cluster.ray.replica_start import start_replicas
from cluster.ray.replica_streams import ReplicaStream
from cluster.ray.router_actor import ROUTER_ACTOR_OPTIONS, RouterActor, RouterAddress
from cluster.ray.serving_policy import ServingPolicy
from cluster.ray.start import init_ray
from kvstore.block_hash import BlockHash, ExtraKeys, hash_full_blocks
from router.admission import Refusal
from router.autoscale import AutoscalingPolicy
from router.kv_pricing import cluster_rates
from router.placement import POLICIES, Decision
from router.replica_router import ClusterHealth, RouterStats
from router.sampling_params import SamplingParams
from workers.catalog import resolve_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterHandles:
    """A running cluster's actors, as another process attaches to them (actor handles pickle):
    several HTTP ingress replicas share one set of engine replicas this way."""

    replicas: list
    router: object
    model_path: str
    max_model_len: int
    kv_hash_keys: tuple[int, ExtraKeys]  # the engines' block size and extra keys
    monitor: object = None  # the ReplicaMonitor's handle
    policy: ServingPolicy = ServingPolicy()


class ReplicaGone(RuntimeError):
    """The router placed a request on a replica the autoscaler has removed since."""


class TandemCluster:
    owns_actors = True  # False for a view attached to another process's cluster
    autoscaler: "ReplicaAutoscaler | None" = None  # only the owner runs one

    def __init__(self, config: EngineConfig, num_replicas: int = 1,
                 routing: str = "prefix-affinity",
                 autoscaling: AutoscalingPolicy | None = None,
                 policy: ServingPolicy | None = None, group: str = "") -> None:
        """``autoscaling``: add and remove replicas with the load, between its bounds
        (``num_replicas`` is the count to start with). ``group``: what the router's name
        starts with, so that ``find_routers(group)`` finds it (a Serve app's name)."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if routing not in POLICIES:
            raise ValueError(f"unknown routing policy {routing!r} (choose from "
                             f"{', '.join(POLICIES)})")
        if not ray.is_initialized():
            init_ray()
        # pull once here, not in every replica at the same time
        resolve_model(config.model, config.cache_dir)
        # every replica is a placement group of its own: refuse at once what no node can hold
        check_placeable(shard_bundle(config.resolved_device.startswith("cuda"),
                                     config.gpu_fraction, config.cpu_shard_cpus),
                        config.tensor_parallel_size, num_replicas)
        self.config = config
        self.policy = policy = policy or ServingPolicy()
        self._streams: dict[int, ReplicaStream] = {}  # by replica index
        # named: the replicas and the monitor find it by its name (RouterAddress)
        self.router_address = RouterAddress.new(group)
        self.router = ray.remote(RouterActor).options(
            **ROUTER_ACTOR_OPTIONS, name=self.router_address.name,
            namespace=self.router_address.namespace).remote(
            num_replicas, routing, policy.admission
        )
        self.replicas = [self._replica_actor(index) for index in range(num_replicas)]
        try:
            infos = start_replicas(self.replicas, self._replica_actor,
                                   policy.replica_start_timeout_s)
        except BaseException:  # a late replica is killed, and its pending group with it
            self._kill_all()
            raise
        self.model_path = resolve_model(str(infos[0]["model_path"]), config.cache_dir)
        self.max_model_len = min(int(info["max_model_len"]) for info in infos)  # type: ignore[call-overload]
        self.kv_hash_keys = infos[0]["kv_hash_keys"]
        # each serving replica's measured rates: pulls are priced over those serving now
        self.measured_rates = {index: info["transfer_rates"] for index, info in enumerate(infos)}
        self.pull_bandwidth: float | None = None  # the object store's, measured once
        self._set_transfer_rates()
        ray.get(self.router.sync_replicas.remote(dict(enumerate(self.replicas))))
        # started once every replica is up and the router lists them, so its first round
        # finds them whole
        self.monitor = ray.remote(ReplicaMonitor).options(**MONITOR_ACTOR_OPTIONS).remote(
            self.router_address, policy.health_check_period_s, policy.health_check_timeout_s)
        self.autoscaler: ReplicaAutoscaler | None = None
        if autoscaling is not None:
            self.autoscaler = ReplicaAutoscaler(self, autoscaling)
            self.autoscaler.start()

    def _set_transfer_rates(self) -> None:
        """Pulls between host tiers are priced from the serving replicas' rates (kv_pricing's
        ``cluster_rates``); set again whenever the autoscaler adds or removes one."""
        rates = cluster_rates(list(self.measured_rates.values()), self._pull_bandwidth)
        ray.get(self.router.set_rates.remote(rates))

    def _pull_bandwidth(self) -> float:
        if self.pull_bandwidth is None:
            self.pull_bandwidth = measure_pull_bandwidth(self.router)
        return self.pull_bandwidth

    def _replica_actor(self, index: int):
        return ray.remote(ReplicaActor).options(**REPLICA_ACTOR_OPTIONS).remote(
            self.config, index, self.router_address)

    def _kill_all(self) -> None:
        for actor in [*self.replicas, self.router]:
            ray.kill(actor)

    def handles(self) -> ClusterHandles:
        return ClusterHandles(list(self.replicas), self.router, str(self.model_path),
                              self.max_model_len, self.kv_hash_keys, self.monitor, self.policy)

    # -- the autoscaler's hooks (cluster/ray/autoscaler.py); indices are never reused -------

    def start_replica(self) -> tuple[int, ray.ObjectRef]:
        """Starts one more replica: its shards ask for a placement group of their own, which a
        full cluster meets by asking Ray's autoscaler for a node. Returns its index and a ref
        that resolves once its engine is built."""
        index = ray.get(self.router.add_replica.remote())
        assert index == len(self.replicas), (index, len(self.replicas))
        replica = self._replica_actor(index)
        self.replicas.append(replica)
        ray.get(self.router.sync_replicas.remote(self.replica_handles()))
        # watched from now: down (degraded health) until its engine answers
        ray.get(self.monitor.set_replicas.remote(list(self.replicas)))
        return index, replica.info.remote()

    def replica_serving(self, index: int, info: dict) -> None:
        """A replica the autoscaler started answers (``info``: what ``ReplicaActor.info``
        says): its rates count from now on."""
        if info["kv_hash_keys"] != self.kv_hash_keys:  # another dtype or device, say
            log.warning("replica %d hashes its blocks with %r, the router with %r: its "
                        "prefixes will not be found", index, info["kv_hash_keys"],
                        self.kv_hash_keys)
        self.measured_rates[index] = info["transfer_rates"]
        self._set_transfer_rates()

    def replica_handles(self) -> dict[int, object]:
        return {index: r for index, r in enumerate(self.replicas) if r is not None}

    def remove_replica(self, index: int, timeout_s: float = 60.0, started: bool = True) -> None:
        """Stops a replica (drained first: see ``ReplicaAutoscaler``) and forgets it.
        ``started`` False: one that never came up is killed, not asked (it would answer only
        once its engine is built)."""
        replica, self.replicas[index] = self.replicas[index], None
        ray.get(self.router.remove_replica.remote(index))
        self.measured_rates.pop(index, None)  # one that never started has none
        self._set_transfer_rates()
        ray.get(self.monitor.set_replicas.remote(list(self.replicas)))
        try:
            if started:
                ray.get(replica.shutdown.remote(), timeout=timeout_s)  # its shards and group
        except (ray.exceptions.RayError, TimeoutError) as error:
            log.warning("replica %d did not shut down cleanly: %r", index, error)
        ray.kill(replica)

    @classmethod
    def attach(cls, handles: ClusterHandles) -> "TandemCluster":
        """A view of a cluster another process started and owns: it sends requests to the
        same replicas through the same router; its ``shutdown`` leaves the actors alone."""
        view = cls.__new__(cls)
        view.replicas, view.router = list(handles.replicas), handles.router
        view.model_path, view.max_model_len = Path(handles.model_path), handles.max_model_len
        view.kv_hash_keys = handles.kv_hash_keys
        view.monitor, view.policy = handles.monitor, handles.policy
        view.owns_actors = False
        view._streams = {}
        return view

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        block_size, extra_keys = self.kv_hash_keys
        salt = (params.cache_salt,) if params.cache_salt else ()
        hashes = hash_full_blocks(prompt_ids, block_size, tuple(extra_keys) + salt)
        accumulator = OutputAccumulator()  # one for all attempts: the caller's one stream

        def attempt(resume: Resume | None,
                    lost: frozenset[int]) -> AsyncGenerator[RequestOutput, None]:
            return self._attempt(request_id, list(prompt_ids), params, hashes, accumulator,
                                 resume, lost)

        async with aclosing(with_failover(request_id, attempt, accumulator,
                                          self.policy)) as outputs:
            async for output in outputs:
                yield output

    async def _attempt(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       hashes: list[BlockHash], accumulator: OutputAccumulator,
                       resume: Resume | None, lost: frozenset[int]
                       ) -> AsyncGenerator[RequestOutput, None]:
        """The request on one replica, from ``resume`` when it continues after a loss; a loss
        of that replica raises ``ReplicaLost``."""
        decision = await self.router.assign.remote(request_id, hashes, len(prompt_ids),
                                                   self.kv_hash_keys[0], sorted(lost),
                                                   bool(lost))
        if isinstance(decision, Refusal):
            raise self._refusal(decision)
        index = decision.replica
        pull = await self._export(decision, prompt_ids, hashes)
        replica = self.replicas[index] if index < len(self.replicas) else None
        if replica is None:  # the autoscaler added it after this view last looked
            replica = await self._refresh_replicas(index)
        stream = self._stream(index)
        queue = stream.open(request_id)
        finished = started = False
        loss: ReplicaLost | None = None
        try:
            # a rebuild is waited for no longer than failover allows, so it cannot hang
            await replica.submit.remote(request_id, prompt_ids, params, stream.consumer_id,
                                        resume, self.policy.failover_timeout_s, pull)
            while not finished:
                # what queued up while the caller was busy leaves as one output: a consumer
                # that falls behind catches up instead of falling further behind
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    output = accumulator.add(item)
                finished = output.finished
                if not started and output.metrics.first_token_time is not None:
                    started = True  # its prefill is done: the router stops counting it
                    self.router.first_token.remote(request_id)
                yield output
        except Exception as error:
            died = process_died(error)
            if died is None:
                raise
            loss = ReplicaLost(index, error, died)
            raise loss from error
        finally:
            stream.close(request_id)
            try:
                if not finished:
                    await replica.abort.remote(request_id)
            except ray.exceptions.RayError:
                pass  # the replica died or is restarting: the request went with its process
            finally:
                if loss is not None:  # placed again by the next attempt, counted a failover
                    await self.router.lost.remote(request_id, index, loss.process_died)
                else:
                    await self.router.release.remote(request_id)

    async def _export(self, decision: Decision, prompt_ids: list[int],
                      hashes: list[BlockHash]) -> ExportedBlocks | None:
        """The blocks the router asked to pull, out of their holder's host tier; None when
        there are none (or the holder failed: the request then recomputes them)."""
        pull = decision.pull
        source = self.replicas[pull.source] if pull is not None and (
            pull.source < len(self.replicas)) else None
        if pull is None or source is None:
            return None
        stop = pull.first_block + pull.num_blocks
        try:
            return await source.export_blocks.remote(
                hashes[pull.first_block:stop],
                block_tokens(prompt_ids, self.kv_hash_keys[0], pull.first_block, pull.num_blocks))
        except ray.exceptions.RayError as error:
            log.warning("replica %d could not export KV blocks: %r", pull.source, error)
            return None

    def _refusal(self, refusal: Refusal) -> Unavailable:
        retry = self.policy.retry_after_s
        if refusal.reason == "draining":
            return Draining("The server is shutting down and takes no new requests: retry "
                            "the request (another replica of the service may take it).", retry)
        return Overloaded("The server is overloaded (every engine replica's queue is full): "
                          "retry the request later.", retry)

    def _stream(self, index: int) -> ReplicaStream:
        """This process's stream from replica ``index``, opened on first use, and again after
        it broke or when the caller runs on another event loop."""
        stream = self._streams.get(index)
        if stream is None or not stream.usable():
            stream = self._streams[index] = ReplicaStream(self.replicas[index])
        return stream

    async def abort(self, request_id: str) -> None:
        await self._on_all("abort", request_id)

    async def health(self) -> ClusterHealth:
        """The health monitor's last view of every replica (through the router)."""
        return await self.router.health.remote()

    async def stats(self) -> list[EngineStats]:
        return await self._on_all("stats")

    async def metrics(self) -> list[MetricsSnapshot]:
        """Every replica's figures now, monotonic across its rebuilds and restarts."""
        if not self.owns_actors:  # the owner's autoscaler may have added or removed some
            await self._refresh_replicas()
        return await self.monitor.metrics.remote()

    async def drain(self, timeout_s: float, poll_s: float = 0.1) -> int:
        """Refuses new requests, then waits up to ``timeout_s`` for those in flight to finish;
        returns how many were still running at the end."""
        return await drain_routers([self.router], timeout_s, poll_s)

    async def router_stats(self) -> RouterStats:
        return await self.router.stats.remote()

    async def _refresh_replicas(self, index: int | None = None) -> object:
        """This view's replica list from the router's (the owner keeps it there)."""
        handles = await self.router.replica_handles.remote()
        self.replicas = [handles.get(i) for i in range(max(handles, default=-1) + 1)]
        if index is not None:
            if handles.get(index) is None:
                raise ReplicaGone(f"replica {index} was removed")
            return handles[index]
        return None

    async def _on_all(self, method: str, *args: object) -> list:
        if not self.owns_actors:  # the owner's autoscaler may have added or removed some
            await self._refresh_replicas()
        return [await getattr(replica, method).remote(*args) for replica in self.replicas
                if replica is not None]

    def shutdown(self) -> None:
        if not self.owns_actors:
            return
        ray.kill(self.monitor)  # first: it would see the replicas stop and report them down
        starting: set[int] = set()
        if self.autoscaler is not None:
            self.autoscaler.stop()
            # one still starting may wait minutes for a node: it is killed, not asked to stop
            starting = set(self.autoscaler.starting)
        handles = self.replica_handles()
        ray.get([r.shutdown.remote() for i, r in handles.items() if i not in starting])
        for actor in [*handles.values(), self.router]:
            ray.kill(actor)


async def drain_routers(routers: Sequence, timeout_s: float, poll_s: float = 0.1) -> int:
    """Each router refuses new requests, then its requests in flight get up to ``timeout_s``
    to finish; how many were still running at the end, in all."""
    async def in_flight(method: str) -> int:
        return sum(await asyncio.gather(*[getattr(r, method).remote() for r in routers]))

    left = await in_flight("drain_all")
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
        left = await in_flight("num_in_flight")
    return left
