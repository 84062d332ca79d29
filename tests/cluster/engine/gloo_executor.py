"""An engine whose shards are the ranks of a gloo group of test processes (tests/workers/
gloo_group.py): rank 0 runs the engine and its own shard, and sends every executor call to the
other ranks first; they carry them out on their shards until rank 0 stops.

Eight Ray actors each import torch and tandem in a process of their own, which on a shared
2-core machine takes minutes; eight ranks forked from one process that imported them once
take seconds (``spawn_ranks``). The worker and its collectives are the Ray shards' own."""

import multiprocessing

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.kv_offload import OffloadInfo
from workers.step_input import StepInput, StepOutput
from workers.worker import Worker

# imported once by the fork server, before it forks the ranks: tandem, and what building a
# worker imports on first use (torch.fx pulls sympy), seconds a rank on a loaded machine
PRELOAD = ["torch", "torch.fx", "safetensors.torch", "transformers.activations",
           "transformers.models.llama.configuration_llama", "cluster.engine.llm_engine",
           "tests.workers.gloo_group"]


class GlooExecutor:
    """Rank 0's executor: every call goes to the other ranks, then to its own shard."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def _send(self, *call) -> None:
        dist.broadcast_object_list([call], src=0)

    def determine_num_kv_blocks(self) -> int:
        self._send("determine_num_kv_blocks")
        return smallest_num_kv_blocks(self.worker)

    def init_kv_cache(self, num_blocks: int) -> OffloadInfo | None:
        self._send("init_kv_cache", num_blocks)
        return self.worker.init_kv_cache(num_blocks)

    def key_centers_digest(self) -> str | None:
        return self.worker.key_centers_digest()  # every rank's, gathered in init_kv_cache

    def execute(self, step: StepInput) -> StepOutput:
        self._send("execute", step)
        output = self.worker.execute(step)
        assert output is not None, "rank 0 samples"
        return output

    def device_stats(self) -> list:
        return []

    def shutdown(self) -> None:
        self._send("stop")


def smallest_num_kv_blocks(worker: Worker) -> int:
    """Every rank holds as many blocks: the smallest rank's count (as RayExecutor's)."""
    count = torch.tensor([worker.determine_num_kv_blocks()])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count)


def follow(worker: Worker) -> None:
    """Ranks > 0: rank 0's calls on this rank's shard, until it stops."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        name, *args = box[0]
        if name == "stop":
            return
        if name == "determine_num_kv_blocks":
            smallest_num_kv_blocks(worker)
        elif name == "init_kv_cache":
            worker.init_kv_cache(*args)
        else:
            worker.execute(*args)


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in nprocs processes forked from a fork server that imported PRELOAD
    (set before the server starts; one started earlier serves them too, importing more)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
