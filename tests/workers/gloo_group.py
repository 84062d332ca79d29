"""A two-process gloo group for CPU tests of tensor parallelism (``torch.multiprocessing``)."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from workers.layers.parallel import TensorParallelGroup


@contextmanager
def gloo_group(rank: int, world_size: int, store_file: str) -> Iterator[TensorParallelGroup]:
    """Joins a gloo group whose rendezvous is a file, not a TCP store one rank hosts, for a
    spawned rank whose work is the block: when the block succeeds, every rank meets at a
    barrier and the process ends there at once (exit code 0). Tearing gloo down and letting the
    interpreter finalize aborted a rank now and then in loaded runs ("terminate called without
    an active exception", a joinable thread destroyed) after its results were saved: with the
    store in rank 0's process, then with a file store and destroy_process_group. A block that
    raises tears down as usual, so the test sees the failure."""
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size)
    try:
        yield TensorParallelGroup.from_process_group()
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()  # every rank's results are written before any rank leaves
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
