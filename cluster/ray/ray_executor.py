"""A replica's shards as Ray actors: one per GPU (or CPU worker), in one placement group."""

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.util import placement_group_table
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.ray.shard_actor import SHARD_ACTOR_OPTIONS, ShardActor
from workers.device_stats import DeviceStats
from workers.kv_offload import OffloadInfo
from workers.step_input import StepInput, StepOutput
from workers.worker import WorkerConfig


class ShardFailure(RuntimeError):
    """A shard actor died or failed mid-step: the replica's requests cannot go on."""


class RayExecutor:
    def __init__(self, config: WorkerConfig, tensor_parallel_size: int) -> None:
        if not ray.is_initialized():
            ray.init()
        on_gpu = config.device.startswith("cuda")
        if on_gpu:  # each actor runs on its own GPU, the current CUDA device it picks
            config = WorkerConfig(**{**config.__dict__, "device": "cuda"})
        gpus = config.gpu_fraction if on_gpu else 0
        bundle = {"GPU": gpus, "CPU": 1} if on_gpu else {"CPU": 1}
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
                num_cpus=1, num_gpus=gpus, **SHARD_ACTOR_OPTIONS,
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

    def _all(self, call) -> list:
        try:
            return ray.get([call(actor) for actor in self.actors])
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
            raise ShardFailure(f"a shard actor failed: {error}") from error

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

    def execute(self, step: StepInput) -> StepOutput:
        assert self.step_graph is not None, "init_kv_cache comes before the first step"
        try:
            refs = self.step_graph.execute(step)
            # ranks > 0 first: a dead one answers at once, where rank 0 may wait in a collective
            outputs = [ray.get(ref) for ref in reversed(refs)]
        except ray.exceptions.RayError as error:
            raise ShardFailure(f"a shard actor failed: {error}") from error
        output = outputs[-1]
        assert output is not None, "rank 0 returns the sampled tokens"
        return output

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
        if self.step_graph is not None:
            self.step_graph.teardown(kill_actors=True)
            self.step_graph = None
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)
