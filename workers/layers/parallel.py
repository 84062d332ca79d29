"""The tensor-parallel group a model's layers shard over, passed into every layer.

Layers never read a module global to learn their rank: two engines (or a test running TP=1 next
to TP=2) can live in one process, each with its own group.

The collectives are written to be capturable in a CUDA graph (NCCL >= 2.9.6): ``all_reduce``
sums in place through NCCL, ``all_gather`` fills one preallocated tensor
(``all_gather_into_tensor``), not a list of tensors. On GPUs, small sums may go through peer
memory instead (``symmetric``, see symmetric_all_reduce.py): the same sum, in one kernel.
"""

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist

from workers.layers.symmetric_all_reduce import SymmetricAllReduce, make_symmetric_all_reduce

# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name); same collective
gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None only when size == 1
    symmetric: SymmetricAllReduce | None = None  # peer-memory sums for small GPU tensors

    @classmethod
    def single(cls) -> "TensorParallelGroup":
        """One process holds the whole model; the collectives are no-ops."""
        return cls(rank=0, size=1)

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None) -> "TensorParallelGroup":
        """Wraps an initialized torch.distributed group (the default world group if None)."""
        group = group or dist.group.WORLD
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    def with_symmetric_all_reduce(self, device: torch.device,
                                  kernel: str = "push") -> "TensorParallelGroup":
        """This group with peer-memory sums where every rank could set them up (a collective);
        unchanged where any could not (the reason is logged)."""
        if self.size == 1 or device.type != "cuda":
            return self
        agree = partial(self.all_true, device=device)
        return replace(self, symmetric=make_symmetric_all_reduce(self.group, device, agree,
                                                                   kernel=kernel))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of t over the ranks: t itself, summed in place by NCCL, or a new tensor from
        the peer-memory path. Use the returned tensor."""
        if self.size == 1:
            return t
        if self.symmetric is not None and self.symmetric.fits(t):
            return self.symmetric(t)
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenates every rank's t along dim, in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        gathered = t.new_empty((self.size * t.shape[0], *t.shape[1:]))  # rank r: rows r*N..
        gather_into_tensor(gathered, t, group=self.group)
        return torch.cat(gathered.chunk(self.size), dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank's t becomes rank src's t (in place); returns t."""
        if self.size > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, src), group=self.group)
        return t

    def any_true_each(self, flags: list[bool], device: torch.device) -> list[bool]:
        """Each flag, true where it holds on any rank (a MAX all-reduce); every rank must call
        it with as many flags."""
        if self.size == 1 or not flags:
            return flags
        value = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in value.tolist()]

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """Whether flag holds on every rank (a MIN all-reduce); every rank must call it."""
        if self.size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())
