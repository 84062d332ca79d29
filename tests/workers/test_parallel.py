"""TensorParallelGroup's collectives over two real gloo processes (CPU)."""

import torch
import torch.multiprocessing as mp

from tests.workers.gloo_group import gloo_group
from workers.layers.parallel import TensorParallelGroup
from workers.layers.symmetric_all_reduce import make_symmetric_all_reduce


def run_rank(rank: int, store_file: str, results) -> None:
    with gloo_group(rank, 2, store_file) as tp:
        cpu = torch.device("cpu")
        local = torch.arange(6.0).view(2, 3) + 10 * rank  # (2, 3)
        results[rank] = {
            "gather_last": tp.all_gather(local, dim=-1).tolist(),  # (2, 6)
            "gather_first": tp.all_gather(local, dim=0).tolist(),  # (4, 3)
            "one_false": tp.all_true(rank == 0, cpu),
            "all_true": tp.all_true(True, cpu),
            "reduce": tp.all_reduce(torch.ones(2) * (rank + 1)).tolist(),
            # rank 0's sampled tokens reach every rank (multi-step decoding under TP)
            "broadcast": tp.broadcast(torch.tensor([7, 8]) + 100 * rank, src=0).tolist(),
            # peer-memory sums are for GPUs: on the CPU the group stays as it was
            "cpu_group_unchanged": tp.with_symmetric_all_reduce(cpu) is tp,
            # a setup that fails on every rank: they agree on NCCL (here gloo) for every sum
            "setup_failed_everywhere": make_symmetric_all_reduce(
                tp.group, cpu, lambda flag: tp.all_true(flag, cpu)) is None,
        }


def test_collectives_over_two_gloo_ranks(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(run_rank, args=(str(tmp_path / "store"), results), nprocs=2)
        results = dict(results)
    expected = {
        "gather_last": [[0.0, 1.0, 2.0, 10.0, 11.0, 12.0], [3.0, 4.0, 5.0, 13.0, 14.0, 15.0]],
        "gather_first": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [10.0, 11.0, 12.0],
                         [13.0, 14.0, 15.0]],
        "one_false": False,  # the ranks agree: graphs only when every rank captured
        "all_true": True,
        "reduce": [3.0, 3.0],
        "broadcast": [7, 8],
        "cpu_group_unchanged": True,
        "setup_failed_everywhere": True,
    }
    assert results == {0: expected, 1: expected}


class FakePeerSums:
    """Stands in for SymmetricAllReduce: takes tensors of 4 values, returns 10x them."""

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() == 4

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t * 10


def test_all_reduce_sends_what_fits_to_the_peer_memory_path():
    tp = TensorParallelGroup(rank=0, size=2, group=None, symmetric=FakePeerSums())  # type: ignore[arg-type]
    t = torch.ones(4)
    assert tp.all_reduce(t).tolist() == [10.0] * 4  # a new tensor; t is left alone
    assert t.tolist() == [1.0] * 4
    single = TensorParallelGroup.single()
    assert single.all_reduce(t) is t and single.with_symmetric_all_reduce(torch.device("cpu")) \
        is single
