"""Linear layers sharded over a tensor-parallel group, Megatron style.

A column-parallel layer splits its outputs across ranks (no communication); a row-parallel layer
splits its inputs and sums the partial products with one all-reduce. An attention block or an
MLP is column then row, so it costs one all-reduce.

Weights are (out_features, in_features) like ``nn.Linear``. Every parameter carries
``weight_loader(param, loaded_weight, shard_id=None)``, which copies this rank's slice of the
full checkpoint tensor into the local shard; the model's loader needs no sharding logic.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.layers.batch_invariant import invariant_linear
from workers.layers.parallel import TensorParallelGroup


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp size {denominator}")
    return numerator // denominator


def copy_shard(dst: torch.Tensor, src: torch.Tensor) -> None:
    # copy_ would broadcast a wrongly shaped tensor silently
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


class ShardedLinear(nn.Module):
    """The local (out_local, in_local) weight and optional bias; subclasses say how to slice.

    With ``gemv_for_one_row`` (set by models built with the fused kernels) an input of one row
    goes through the Triton matrix-vector kernel (workers/layers/gemv.py) instead of cuBLAS.
    With ``batch_invariant`` every product is taken in tiles whose rows' bits do not depend on
    the call's other rows (workers/layers/batch_invariant.py).
    """

    gemv_for_one_row = False
    batch_invariant = False

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        # uninitialized: every value is overwritten by load_weights
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_linear(x, self.weight, bias)
        if self.gemv_for_one_row and x.shape[0] == 1:
            # imported here: models built without the fused kernels must not need Triton
            from workers.layers.gemv import gemv

            return gemv(x, self.weight, bias)[0]
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(ShardedLinear):
    """Rank r holds output rows [r * out/tp, (r + 1) * out/tp); its output stays sharded."""

    def __init__(
        self, input_size: int, output_size: int, tp: TensorParallelGroup, bias: bool = False
    ):
        super().__init__(input_size, divide(output_size, tp.size, "output size"), bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        copy_shard(param.data, loaded.narrow(0, self.tp.rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input in one matmul (gate_proj and up_proj).

    The local weight stacks each layer's local rows: [gate shard | up shard]. shard_id is the
    index of the checkpoint tensor in output_sizes.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], tp: TensorParallelGroup, bias: bool = False
    ):
        self.local_sizes = [divide(s, tp.size, "output size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), tp, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        n = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        copy_shard(param.data.narrow(0, offset, n), loaded.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(ShardedLinear):
    """q_proj, k_proj and v_proj in one matmul; local rows are [q heads | k heads | v heads].

    Query heads split evenly. KV heads split evenly when there are at least tp of them;
    otherwise each rank holds one KV head, replicated on tp / kv_heads ranks (the vLLM scheme):
    rank r holds KV head r * kv_heads // tp, which is the head its local query heads attend with.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TensorParallelGroup,
        bias: bool = False,
    ):
        self.head_dim = head_dim
        self.num_local_heads = divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_local_kv_heads = divide(num_kv_heads, tp.size, "kv heads")
            self.kv_shard_index = tp.rank
        else:
            divide(tp.size, num_kv_heads, "tp size must be a multiple of kv heads; tp size")
            self.num_local_kv_heads = 1
            self.kv_shard_index = tp.rank * num_kv_heads // tp.size
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id == "q":
            offset, n, src_start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            n, src_start = self.kv_size, self.kv_shard_index * self.kv_size
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_shard(param.data.narrow(0, offset, n), loaded.narrow(0, src_start, n))


class RowParallelLinear(ShardedLinear):
    """Rank r holds input columns [r * in/tp, (r + 1) * in/tp); partial outputs are all-reduced.

    The bias is replicated and added once, after the reduce, so it is not counted tp times.
    """

    def __init__(
        self, input_size: int, output_size: int, tp: TensorParallelGroup, bias: bool = False
    ):
        super().__init__(divide(input_size, tp.size, "input size"), output_size, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias:
            copy_shard(param.data, loaded)
            return
        n = param.shape[1]
        copy_shard(param.data, loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # one fused addmm, the same arithmetic as HF's nn.Linear
            return self.matmul(x, self.bias)
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += self(x), in place (residual: the decoder's residual stream, (T, out)).
        On one rank without a bias it is one GEMM that reads residual as its C operand (one
        rounding, where the separate add rounds twice); otherwise the output is added after."""
        if self.tp.size == 1 and self.bias is None and not self.batch_invariant:
            return residual.addmm_(x, self.weight.t())
        return residual.add_(self(x))
