"""The tensor-parallel group a model's layers shard over, passed into every layer.

Layers never read a module global to learn their rank: two engines (or a test running TP=1 next
to TP=2) can live in one process, each with its own group.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None only when size == 1

    @classmethod
    def single(cls) -> "TensorParallelGroup":
        """One process holds the whole model; the collectives are no-ops."""
        return cls(rank=0, size=1)

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None) -> "TensorParallelGroup":
        """Wraps an initialized torch.distributed group (the default world group if None)."""
        group = group or dist.group.WORLD
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks, in place; returns t for chaining."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenates every rank's t along dim, in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)
