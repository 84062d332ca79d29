"""A replica's shards as Ray actors: one per GPU (or CPU worker), in one placement group.

Steps go to the shards through a compiled graph. Its loop in each shard waits for the next
step by polling a shared-memory channel, which holds a core busy while the replica is idle;
``park`` sends the shards a step that waits on an event instead, and the next step lets them
go first (one ordinary call a shard, ~1 ms, only after an idle spell). Reading a step's result
polls too: the replica waits for the shards' notices first (step_notice.py).
"""

import contextlib

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.util import placement_group_table
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.ray.placement import check_placeable, shard_bundle
from cluster.ray.shard_actor import SHARD_ACTOR_OPTIONS, Park, ShardActor
from cluster.ray.start import init_ray
from cluster.ray.step_notice import StepNotices
from workers.device_stats import DeviceStats
from workers.host_layout import OffloadInfo
from workers.step_input import StepInput, StepOutput
from workers.worker import WorkerConfig


class ShardFailure(RuntimeError):
    """A shard actor died or failed mid-step: the replica's requests cannot go on."""


class RayExecutor:
    def __init__(self, config: WorkerConfig, tensor_parallel_size: int) -> None:
        if not ray.is_initialized():
            init_ray()
        on_gpu = config.device.startswith("cuda")
        if on_gpu:  # each actor runs on its own GPU, the current CUDA device it picks
            config = WorkerConfig(**{**config.__dict__, "device": "cuda"})
        bundle = shard_bundle(on_gpu, config.gpu_fraction, config.cpu_shard_cpus)
        # a group no node can hold would wait for ever: refuse it now, saying why
        check_placeable(bundle, tensor_parallel_size)
        # STRICT_PACK: every shard of one replica on one node, where NVLink joins the GPUs
        self.placement_group: PlacementGroup = placement_group(
            [bundle] * tensor_parallel_size, strategy="STRICT_PACK"
        )
        try:
            ray.get(self.placement_group.ready(), timeout=600)
        except ray.exceptions.GetTimeoutError:
            # a pending group is demand Ray's autoscaler keeps trying to meet with a node
            remove_placement_group(self.placement_group)
            raise
        self.actors = [
            ray.remote(ShardActor).options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), **SHARD_ACTOR_OPTIONS,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(config, rank, tensor_parallel_size)
            for rank in range(tensor_parallel_size)
        ]
        address = ray.get(self.actors[0].rendezvous_address.remote())
        # the replica's GPUs, in the ids Ray gave them: every shard sees them all (peer memory
        # between shards needs each rank on a device index of its own)
        replica_gpus = sorted({gpu for ids in self._all(lambda a: a.gpu_ids.remote())
                               for gpu in ids})
        self._all(lambda actor: actor.init_worker.remote(address, replica_gpus))
        self.step_graph = None  # compiled once the KV cache exists (init_kv_cache)
        self.parked: list | None = None  # the refs of the Park step the shards are held in
        self.notices = self._connect_notices()

    def _all(self, call) -> list:
        try:
            return ray.get([call(actor) for actor in self.actors])
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
            raise ShardFailure(f"a shard actor failed: {error}") from error

    def _connect_notices(self) -> StepNotices | None:
        """A FIFO a shard, where every shard is on this node; else None (results polled)."""
        notices = StepNotices(len(self.actors))
        connected = ray.get([actor.connect_notice.remote(path)
                             for actor, path in zip(self.actors, notices.paths, strict=True)])
        if all(connected):
            return notices
        notices.close()  # the shards that did connect see a closed pipe and stop writing
        return None

    def determine_num_kv_blocks(self) -> int:
        # every rank holds the same number of blocks: the smallest one decides
        return min(self._all(lambda actor: actor.determine_num_kv_blocks.remote()))

    def init_kv_cache(self, num_blocks: int) -> OffloadInfo | None:
        # every shard's host buffer has as many slots (the same block shapes): rank 0's says
        infos = self._all(lambda actor: actor.init_kv_cache.remote(num_blocks))
        # A compiled graph sends each step through shared-memory channels set up once:
        # a fraction of a millisecond, where an ordinary actor call per rank costs several.
        with InputNode() as step:
            graph = MultiOutputNode([actor.execute.bind(step) for actor in self.actors])
        self.step_graph = graph.experimental_compile()
        return infos[0]

    def key_centers_digest(self) -> str | None:
        return ray.get(self.actors[0].key_centers_digest.remote())  # every rank's: worker.py

    def park(self) -> None:
        """Holds every shard in a blocking wait until the next step (the replica is idle)."""
        if self.parked is not None or self.step_graph is None:
            return
        try:
            self.parked = self.step_graph.execute(Park())
        except ray.exceptions.RayError as error:
            raise ShardFailure(f"a shard actor failed: {error}") from error

    def _unpark(self) -> None:
        refs, self.parked = self.parked, None
        self._all(lambda actor: actor.unpark.remote())
        for ref in reversed(refs):  # the Park step's results, read before the next step's
            ray.get(ref)

    def execute(self, step: StepInput) -> StepOutput:
        assert self.step_graph is not None, "init_kv_cache comes before the first step"
        try:
            if self.parked is not None:
                self._unpark()
            refs = self.step_graph.execute(step)
            if self.notices is not None:
                self.notices.wait()  # asleep while the shards work, not polling
            # ranks > 0 first: a dead one answers at once, where rank 0 may wait in a collective
            outputs = [ray.get(ref) for ref in reversed(refs)]
            if self.notices is not None:
                self.notices.drain()
        except ray.exceptions.RayError as error:
            raise ShardFailure(f"a shard actor failed: {error}") from error
        output = outputs[-1]
        assert output is not None, "rank 0 returns the sampled tokens"
        return output

    def export_host_slots(self, slots: list[int]) -> list[ray.ObjectRef]:
        """Each shard's bytes of the slots, rank 0 first, as object refs: the bytes go from
        the shards into Ray's object store, never through this process."""
        return [actor.export_host_slots.remote(slots) for actor in self.actors]

    def stage_host_import(self, import_id: str, shard_rows: list) -> list[ray.ObjectRef]:
        """Rank r's rows (an object ref from another replica's rank r) staged in shard r;
        refs to await."""
        if len(shard_rows) != len(self.actors):
            raise ValueError(f"{len(shard_rows)} shards' blocks for {len(self.actors)} shards")
        return [actor.stage_host_import.remote(import_id, rows)
                for actor, rows in zip(self.actors, shard_rows, strict=True)]

    def profile(self, fn) -> list[str]:
        """Runs fn with torch.profiler on in every shard; each rank's table, rank 0 first."""
        self._all(lambda actor: actor.start_profile.remote())
        try:
            fn()
        finally:
            tables = self._all(lambda actor: actor.stop_profile.remote())
        return tables

    def device_stats(self) -> list[DeviceStats]:
        """Each shard's GPU, rank 0 first; empty on the CPU."""
        stats = self._all(lambda actor: actor.device_stats.remote())
        return [shard for shard in stats if shard is not None]

    def ping(self) -> list:
        """One small call to every shard, as object refs to await: a dead shard's raises."""
        return [actor.pid.remote() for actor in self.actors]

    def shard_pids(self) -> list[int]:
        return self._all(lambda actor: actor.pid.remote())

    def shard_nodes(self) -> list[str]:
        """The Ray node id of each shard, rank 0 first: where its placement group put it."""
        nodes = placement_group_table(self.placement_group)["bundles_to_node_id"]
        return [nodes[rank] for rank in range(len(self.actors))]

    def shutdown(self) -> None:
        if self.parked is not None:  # else teardown waits for loops that wait for us
            # a dead shard: teardown ends the others' loops
            with contextlib.suppress(ShardFailure, ray.exceptions.RayError):
                self._unpark()
        if self.step_graph is not None:
            self.step_graph.teardown(kill_actors=True)
            self.step_graph = None
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)
        if self.notices is not None:
            self.notices.close()
