"""One tensor-parallel shard of a replica, in its own Ray actor (one per GPU or CPU worker)."""

import os
import socket
import threading
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from cluster import environment
from cluster.ray.step_notice import StepNoticeSender
from workers.device_stats import DeviceStats
from workers.host_layout import OffloadInfo
from workers.layers.parallel import TensorParallelGroup
from workers.step_input import StepInput, StepOutput
from workers.worker import Worker, WorkerConfig

# Ray must not restart a shard on its own: a restarted shard has lost its process group and its
# KV cache, so the replica that owns it fails its requests and rebuilds every shard instead.
SHARD_ACTOR_OPTIONS = {"max_restarts": 0, "max_task_retries": 0}


def free_address() -> str:
    """host:port of a port that is free right now on this node (no fixed ports)."""
    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind(("", 0))
        return f"{host}:{sock.getsockname()[1]}"


class Park:
    """A step that holds the shard's compiled-graph loop in a blocking wait until ``unpark``:
    that loop waits for its next step by polling its input channel, a whole core per idle
    shard (RayExecutor.park)."""


class ShardActor:
    """Made a Ray actor with ``ray.remote(ShardActor)`` at run time: a class left undecorated
    in its module pickles by reference, so actors import it rather than receive its code."""

    def __init__(self, config: WorkerConfig, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        if config.device == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.worker: Worker | None = None
        self.profiler = None  # a torch.profiler between start_profile and stop_profile
        self.unparked = threading.Event()  # set by ``unpark``, from Ray's ordinary call thread
        self.notice = StepNoticeSender()  # tells the replica a step ended (step_notice.py)

    def rendezvous_address(self) -> str:
        return free_address()

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this actor, as CUDA_VISIBLE_DEVICES names them."""
        return [str(gpu) for gpu in ray.get_gpu_ids()]

    def init_worker(self, address: str, replica_gpus: list[str] | None = None) -> None:
        """Joins the replica's process group, then loads this rank's shard of the weights.

        replica_gpus: every GPU of the replica (one per rank, on this node). Ray shows an actor
        only its own GPU, as cuda:0 in every rank; PyTorch's peer-memory rendezvous refuses
        ranks on the same device index, so each shard sees all of them and picks its own."""
        on_gpu = self.config.device.startswith("cuda")
        environment.prepare_shard_process(on_gpu, self.world_size > 1, replica_gpus)
        if on_gpu and replica_gpus:
            own = self.gpu_ids()
            assert len(own) == 1 and own[0] in replica_gpus, (own, replica_gpus)
            torch.cuda.set_device(replica_gpus.index(own[0]))
        tp = TensorParallelGroup.single()
        if self.world_size > 1:
            # bound to this rank's GPU: NCCL would otherwise guess cuda:<rank> for barriers
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
            dist.init_process_group(
                "nccl" if on_gpu else "gloo", init_method=f"tcp://{address}",
                rank=self.rank, world_size=self.world_size, timeout=timedelta(minutes=5),
                device_id=device,
            )
            tp = TensorParallelGroup.from_process_group()
            if device is not None and self.config.symmetric_all_reduce:
                tp = tp.with_symmetric_all_reduce(device, self.config.peer_sum_kernel)
        self.worker = Worker(self.config, tp)

    def determine_num_kv_blocks(self) -> int:
        assert self.worker is not None
        return self.worker.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> OffloadInfo | None:
        assert self.worker is not None
        return self.worker.init_kv_cache(num_blocks)

    def key_centers_digest(self) -> str | None:
        assert self.worker is not None
        return self.worker.key_centers_digest()

    def connect_notice(self, path: str) -> bool:
        """Tells the end of each step through the replica's FIFO ``path`` (step_notice.py);
        False where this node has none."""
        return self.notice.connect(path)

    def execute(self, step: StepInput | Park) -> StepOutput | None:
        if isinstance(step, Park):
            # runs on the compiled graph's thread; ordinary calls (unpark, pings) on another
            self.unparked.wait()
            self.unparked.clear()
            return None
        assert self.worker is not None
        try:
            return self.worker.execute(step)
        finally:  # a failed step too: the replica reads the error at once
            self.notice.send()

    def export_host_slots(self, slots: list[int]) -> torch.Tensor:
        """Beside the compiled graph's steps: the slots are pinned by the engine meanwhile."""
        assert self.worker is not None
        return self.worker.export_host_slots(slots)

    def stage_host_import(self, import_id: str, rows: torch.Tensor) -> None:
        """``rows``: another replica's shard of the same rank exported them (Ray resolves the
        object ref it was sent as)."""
        assert self.worker is not None
        self.worker.stage_host_import(import_id, rows)

    def unpark(self) -> None:
        """Lets a parked compiled-graph loop go on (one ``Park`` step; an early call counts)."""
        self.unparked.set()

    def device_stats(self) -> DeviceStats | None:
        """Called at scrape time beside the compiled graph's steps: NVML and the allocator's
        counters only, nothing that waits for the device."""
        assert self.worker is not None
        return self.worker.device_stats()

    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (all ranks agree at capture)."""
        assert self.worker is not None
        return self.worker.graphs is not None

    def uses_symmetric_all_reduce(self) -> bool:
        """Whether small sums go through peer memory rather than NCCL (all ranks agree)."""
        assert self.worker is not None
        return self.worker.tp.symmetric is not None

    def start_profile(self) -> None:
        """torch.profiler over this shard's next steps, until ``stop_profile`` (benchmarks)."""
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.config.device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        try:  # steps run on the compiled graph's thread, not the one calling this
            config = _ExperimentalConfig(profile_all_threads=True)
        except TypeError:  # PyTorch without it: device kernels are still recorded
            config = None
        self.profiler = profile(activities=activities, experimental_config=config)
        self.profiler.start()

    def stop_profile(self) -> str:
        """The profiled steps' table: device time by kernel (host time on the CPU)."""
        if self.config.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.profiler.stop()
        on_gpu = self.config.device.startswith("cuda")
        return self.profiler.key_averages().table(
            sort_by="cuda_time_total" if on_gpu else "cpu_time_total", row_limit=25,
            max_name_column_width=60)

    def pid(self) -> int:
        return os.getpid()
