"""A two-process gloo group for CPU tests of tensor parallelism (``torch.multiprocessing``)."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from workers.layers.parallel import TensorParallelGroup


@contextmanager
def gloo_group(rank: int, world_size: int, store_file: str) -> Iterator[TensorParallelGroup]:
    """Joins a gloo group whose rendezvous is a file, not a TCP store one rank hosts: with the
    store in rank 0's process, rank 0 finishing first aborted rank 1 in loaded runs ("terminate
    called without an active exception"). Every rank is done before any tears down."""
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size)
    try:
        yield TensorParallelGroup.from_process_group()
        dist.barrier()
    finally:
        dist.destroy_process_group()
