"""One replica of the model: an LLMEngine in a Ray actor, stepped by an asyncio loop.

Outputs travel as deltas (a step sends each request's new tokens and text, never its whole
token list again), and by consumer, not by request: each process that sends requests here
(an HTTP ingress replica, an in-process caller) holds one ``subscribe`` stream, and every
step's deltas for all of its requests cross Ray as one message. A message costs ~0.2 ms of
this actor's CPU whatever it carries (tools/profile/ray_streams.py), in the process that also
steps the engine: one per request per step added up to a good part of a core.

Adds and aborts are applied between steps, by the loop, so the engine is only ever touched by
one thread at a time while a step runs in a worker thread (the event loop that takes requests
and sends deltas never waits for a step). An engine idle for ``PARK_AFTER_S`` parks its shards
(ray_executor.py): an idle replica uses no CPU to speak of. After each step the blocks that
entered or left the prefix cache go to the router as one numbered batch (not awaited), which
keeps the cluster's KV directory; a router that missed one asks for ``dump_cache``.

If a shard dies (found by a failed step, or by the health monitor's ping while idle), every
in-flight request ends with ``ReplicaFailure``, which the ingress answers by continuing it on
another replica (failover.py), and the replica rebuilds its engine (new shard actors, new
process group, a new KV epoch: the router forgets its blocks). What the old engine counted is
kept (``retired``), so the replica's counters never go backwards.
"""

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from cluster import environment
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.metrics import (
    LoadSample,
    MetricsSnapshot,
    cumulative,
    empty_snapshot,
    idle,
)
from cluster.engine.outputs import EngineStats, RequestDelta
from cluster.engine.resume import Resume
from cluster.ray.heartbeat import Heartbeat
from cluster.ray.kv_pull import ExportedBlocks, export_blocks, import_pull, stage_pull
from cluster.ray.ray_executor import ShardFailure
from cluster.ray.router_actor import RouterAddress
from kvstore.directory import CacheDump
from router.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Ray restarts a replica whose own process dies; it then builds a fresh engine in __init__.
REPLICA_ACTOR_OPTIONS = {"max_restarts": 3, "max_task_retries": 0, "num_cpus": 0}
# idle this long, the shards stop polling for steps; the next step costs ~1 ms more
PARK_AFTER_S = 0.5


class ReplicaFailure(RuntimeError):
    """The replica lost its engine while the request was in flight."""


class ReplicaActor:
    def __init__(self, config: EngineConfig, replica_id: int = 0,
                 router: RouterAddress | None = None) -> None:
        # every ray.get here runs in this constructor (before any call is taken) or on a worker
        # thread (steps, rebuilds, shard pids, metrics), never on the event loop
        environment.quiet_blocking_get_warning()
        # shards always run as actors, so a dead shard is seen and the replica survives it
        self.config = replace(config, distributed_executor_backend="ray")
        self.replica_id = replica_id
        # the RouterActor's handle, or None; looked up by name, again after a restart
        self.router = None if router is None else router.lookup()
        self.incarnation = uuid.uuid4().hex  # this process's (heartbeat.py)
        self.snapshots = itertools.count()
        self.retired = empty_snapshot()  # what engines this process replaced had counted
        self.engine: LLMEngine | None = self._new_engine()
        self.dead_reason: str | None = None
        # an engine found broken outside a step (a shard that no longer answers a ping): the
        # step loop rebuilds it, the one place that does, so a step failing at the same time
        # cannot cause a second rebuild
        self.broken: tuple[LLMEngine, str] | None = None
        self.ready = asyncio.Event()  # cleared while the engine is being rebuilt
        self.ready.set()
        self.consumers: dict[str, asyncio.Queue[tuple[str, RequestDelta | Exception]]] = {}
        self.owners: dict[str, str] = {}  # request id -> the consumer its deltas go to
        self.pending: list[tuple[str, Callable[[], object],
                                 Callable[[Exception], object] | None]] = []
        self.wakeup: asyncio.Event | None = None
        self.loop_task: asyncio.Task[None] | None = None
        self._tell_router("replica_up", replica_id)  # after a restart, too

    def set_router(self, router: object) -> None:
        """Sends the next KV event batches to another router (one that was restarted)."""
        self.router = router

    def _new_engine(self) -> LLMEngine:
        return LLMEngine(self.config, replica_index=self.replica_id)

    def _tell_router(self, method: str, *args: object) -> None:
        if self.router is not None:
            getattr(self.router, method).remote(*args)  # not awaited: the loop goes on

    def info(self) -> dict[str, object]:
        engine = self._engine()
        return {"model_path": str(engine.model_path), "max_model_len": engine.max_model_len,
                "kv_hash_keys": engine.kv_hash_keys, "transfer_rates": engine.transfer_rates}

    async def subscribe(
        self, consumer_id: str
    ) -> AsyncIterator[list[tuple[str, RequestDelta | Exception]]]:
        """Every delta of the requests ``consumer_id`` submits, and any error that ends one,
        as (request id, delta or error): what queued up since the last message travels as one
        list. Closing the stream aborts the consumer's unfinished requests."""
        queue = self.consumers.setdefault(consumer_id, asyncio.Queue())
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
        finally:
            self.consumers.pop(consumer_id, None)
            for request_id in [r for r, owner in self.owners.items() if owner == consumer_id]:
                await self.abort(request_id)

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     consumer_id: str, resume: Resume | None = None,
                     wait_s: float | None = None, pull: ExportedBlocks | None = None) -> None:
        """Queues a request; its deltas go to ``consumer_id``'s stream. Bad input raises here,
        before anything is queued. ``resume``: it continues what a lost replica started.
        A request that arrives during a rebuild waits for it, up to ``wait_s``. ``pull``:
        blocks of its prefix another replica exported, taken into this one's host tier first
        (kv_pull.py)."""
        try:
            await asyncio.wait_for(self.ready.wait(), wait_s)
        except TimeoutError:
            raise ReplicaFailure(f"replica {self.replica_id} is still rebuilding after "
                                 f"{wait_s} s") from None
        engine = self._engine()
        engine.check_prompt(prompt_ids)
        if request_id in self.owners:
            raise ValueError(f"request id '{request_id}' is already in use")
        self.consumers.setdefault(consumer_id, asyncio.Queue())  # subscribe may come second
        self.owners[request_id] = consumer_id
        import_id = await stage_pull(engine, pull) if pull is not None else None

        def add() -> None:
            # staged in this engine's shards: a rebuilt one has none of it
            if import_id is not None and pull is not None and self.engine is engine:
                import_pull(engine, import_id, pull)
            engine.add_request(prompt_ids, params, request_id, resume)

        self._submit(request_id, add)

    async def export_blocks(self, hashes: list, token_ids: list[list[int]]
                            ) -> ExportedBlocks | None:
        """The leading blocks of ``hashes`` this replica's host tier holds, in the object
        store for another replica (kv_pull.py); None when it holds none."""
        return await export_blocks(self._engine(), self._between_steps, self.replica_id,
                                   hashes, token_ids)

    async def _between_steps(self, call: Callable[[], object]) -> object:
        """Runs ``call`` on the loop between two steps; its result."""
        done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._submit("", lambda: done.set_result(call()), on_error=done.set_exception)
        return await done

    async def abort(self, request_id: str) -> None:
        self.owners.pop(request_id, None)
        self._submit(request_id, lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.abort(request_id)

    def _deliver(self, request_id: str, item: RequestDelta | Exception) -> None:
        """To the request's consumer; its last delta or an error ends the request here."""
        ends = isinstance(item, Exception) or item.finished
        owner = self.owners.pop(request_id, None) if ends else self.owners.get(request_id)
        queue = self.consumers.get(owner) if owner is not None else None
        if queue is not None:
            queue.put_nowait((request_id, item))

    def _submit(self, request_id: str, operation: Callable[[], object],
                on_error: Callable[[Exception], object] | None = None) -> None:
        """Runs ``operation`` between steps; an error goes to ``on_error``, else to the
        request's caller."""
        self.pending.append((request_id, operation, on_error))
        self._wake()

    def _wake(self) -> None:
        if self.loop_task is None:
            self.wakeup = asyncio.Event()
            self.loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        assert self.wakeup is not None
        self.wakeup.set()

    async def _step_loop(self) -> None:
        assert self.wakeup is not None
        while True:
            if not self.pending and not self.broken and not (
                    self.engine and self._has_work(self.engine)):
                self.wakeup.clear()
                await self._idle()
            if self.broken is not None:
                broken, self.broken = self.broken, None
                if broken[0] is self.engine:  # else a failed step has rebuilt it already
                    await self._recover(broken[1])
            self._apply_pending()
            if self.engine is None or not self._has_work(self.engine):
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step_deltas)
            except ShardFailure as error:
                await self._recover(f"lost a shard and is rebuilding: {error}")
                continue
            except Exception as error:  # the engine's state can't be trusted after this
                log.exception("engine step failed")
                await self._recover(f"failed a step and is rebuilding: {error!r}")
                continue
            for output in outputs:
                self._deliver(output.request_id, output)
            self._publish_kv_events()

    @staticmethod
    def _has_work(engine: LLMEngine) -> bool:
        """Requests to step, or copies between tiers (an idle engine's write-through)."""
        return engine.has_unfinished() or engine.has_pending_transfers()

    async def _idle(self) -> None:
        """Waits for work; idle past PARK_AFTER_S, the engine's shards are parked first."""
        assert self.wakeup is not None
        try:
            await asyncio.wait_for(self.wakeup.wait(), PARK_AFTER_S)
            return
        except TimeoutError:
            pass
        engine = self.engine
        if engine is not None:
            try:
                await asyncio.to_thread(engine.executor.park)  # type: ignore[attr-defined]
            except ShardFailure as error:
                self.broken = (engine, f"lost a shard and is rebuilding: {error}")
                return
        await self.wakeup.wait()

    def _publish_kv_events(self) -> None:
        publisher = self.engine.kv_events if self.engine is not None else None
        batch = publisher.take_batch() if publisher is not None else None
        if batch is not None and self.router is not None:
            answer = self.router.report_events.remote(batch)  # type: ignore[attr-defined]
            asyncio.get_running_loop().create_task(self._resync_if_asked(answer))

    async def _resync_if_asked(self, answer: object) -> None:
        """The router found a gap in our batches (it restarted, or one was lost): send it our
        cache dump, again while it still finds one."""
        try:
            while await answer:  # type: ignore[misc]
                answer = self.router.resync.remote(await self.dump_cache())  # type: ignore[attr-defined]
        except Exception as error:  # a router restarting: its next answer asks again
            log.warning("replica %d could not resync the router: %r", self.replica_id, error)

    async def dump_cache(self) -> CacheDump:
        """Every block hash the engine's prefix cache holds, taken between steps."""
        done: asyncio.Future[CacheDump] = asyncio.get_running_loop().create_future()

        def take() -> None:
            publisher = self._engine().kv_events
            assert publisher is not None
            done.set_result(publisher.dump())

        self._submit("", take, on_error=done.set_exception)
        return await done

    def _apply_pending(self) -> None:
        pending, self.pending = self.pending, []
        for request_id, operation, on_error in pending:
            try:
                operation()
            except Exception as error:  # the request's caller learns why
                if on_error is not None:
                    on_error(error)
                else:
                    self._deliver(request_id, error)

    async def _recover(self, what: str) -> None:
        message = f"replica {self.replica_id} {what}"
        log.error(message)
        self._tell_router("replica_down", self.replica_id)
        for request_id in list(self.owners):
            self._deliver(request_id, ReplicaFailure(message))
        old, self.engine = self.engine, None
        self.dead_reason = message
        self.ready.clear()
        if old is not None:
            # on the loop: while it ran elsewhere, metrics() would report neither engine
            self.retired = idle(cumulative(self.retired, old.metrics_snapshot()))
            await asyncio.to_thread(old.shutdown)
        try:
            self.engine = await asyncio.to_thread(self._new_engine)
            self.dead_reason = None
            self._tell_router("replica_up", self.replica_id)
        except Exception as rebuild_error:
            self.dead_reason = f"replica {self.replica_id} could not rebuild: {rebuild_error}"
            log.error(self.dead_reason)
        finally:
            self.ready.set()

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise ReplicaFailure(self.dead_reason or f"replica {self.replica_id} has no engine")
        return self.engine

    async def heartbeat(self, timeout_s: float) -> Heartbeat:
        """The health monitor's ping: pings every shard too, and a dead one makes the replica
        rebuild now rather than when the next request's step fails."""
        return Heartbeat(self.incarnation, next(self.snapshots), await self.metrics(),
                         await self._problem(timeout_s))

    async def _problem(self, timeout_s: float) -> str | None:
        engine = self.engine
        if engine is None:
            return self.dead_reason or f"replica {self.replica_id} has no engine"
        try:
            await asyncio.wait_for(asyncio.gather(*engine.executor.ping()),  # type: ignore[attr-defined]
                                   timeout_s)
        except TimeoutError:  # busy or hung: reported, but not rebuilt on a guess
            return f"replica {self.replica_id}: a shard did not answer within {timeout_s} s"
        except Exception as error:  # a dead shard actor
            message = f"lost a shard and is rebuilding: {type(error).__name__}"
            if self.engine is engine and self.broken is None:
                self.broken = (engine, message)
                self._wake()
            return f"replica {self.replica_id} {message}"
        return None

    async def stats(self) -> EngineStats:
        return self._engine().stats()

    async def metrics(self) -> MetricsSnapshot:
        """Counters and histograms since this process started, across engine rebuilds; the
        gauges of the engine running now (zero while it is rebuilt)."""
        engine, retired = self.engine, self.retired
        if engine is None:
            return retired
        # in a thread: the snapshot asks every shard for its device stats. ``retired`` as it
        # was before: a rebuild meanwhile adds this engine's final counts to it
        return cumulative(retired, await asyncio.to_thread(engine.metrics_snapshot))

    async def load_sample(self) -> LoadSample:
        """The autoscaler's signals, each second: no histogram copies, no shard calls."""
        return self._engine().load_sample()

    async def shard_pids(self) -> list[int]:
        executor = self._engine().executor
        return await asyncio.to_thread(executor.shard_pids)  # type: ignore[attr-defined]

    async def shard_nodes(self) -> list[str]:
        """The Ray node of each of its shards, rank 0 first."""
        return self._engine().executor.shard_nodes()  # type: ignore[attr-defined]

    async def shutdown(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
            self.engine = None
            self.dead_reason = f"replica {self.replica_id} was shut down"
