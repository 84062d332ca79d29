"""One-shot all-reduce through peer GPU memory, for the small sums of decode steps.

A decode step of a tensor-parallel model all-reduces two hidden-state rows per layer (attention
and MLP outputs): 8 KB at batch 1 for an 8B model, 65 times a step. Inside a CUDA graph NCCL
takes ~21 µs for each, this path 6.5 µs (cluster/bench/all_reduce.py, two H200s). Here each
rank's partial sum is copied into a buffer every rank of the group has mapped (PyTorch
symmetric memory over NVLink); one kernel then waits at a barrier, reads the peers' buffers,
sums and writes the result: one launch, one hop.

Only the peer-pointer kernel is used, never NVLink multicast (``multimem``): the copy-in, the
barrier before the reads and the barrier after them are all inside
``symm_mem::one_shot_all_reduce_copy``, so the one buffer is safe to reuse by the next call.
Tensors larger than ``max_bytes``, other dtypes and CPU tensors go to NCCL.
"""

import logging
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 20  # decode batches up to 256 rows of 8192 bf16 values
# the CUDA kernel is compiled for these dtypes only (no float16)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


class SymmetricAllReduce:
    def __init__(self, group: dist.ProcessGroup, device: torch.device,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        # no multicast object at the rendezvous: nothing here uses it, and on some hosts creating
        # one is unsafe (read by PyTorch when the first buffer is mapped)
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        if hasattr(symm_mem, "get_backend") and symm_mem.get_backend(device) is None:
            symm_mem.set_backend("CUDA")  # peer pointers through the CUDA driver, not NVSHMEM
        with warnings.catch_warnings():  # needed by older PyTorch; a deprecated no-op in 2.11
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group)  # collective: every rank maps every buffer

    def fits(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        return (t.is_cuda and t.dtype in SUPPORTED_DTYPES and t.is_contiguous()
                and 0 < nbytes <= self.max_bytes and nbytes % 4 == 0)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of t over the group, in a new tensor (t is left as it was)."""
        staging = self.buffer.view(t.dtype)[: t.numel()].view(t.shape)
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):  # PyTorch < 2.9
            staging.copy_(t)
            return torch.ops.symm_mem.one_shot_all_reduce(staging, "sum", self.group_name)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, t, "sum", self.group_name)


def make_symmetric_all_reduce(group: dist.ProcessGroup, device: torch.device,
                              all_ranks: Callable[[bool], bool],
                              max_bytes: int = DEFAULT_MAX_BYTES) -> SymmetricAllReduce | None:
    """A SymmetricAllReduce if every rank of the group could set one up, else None and NCCL
    does every sum. ``all_ranks(flag)`` tells whether flag holds on every rank (a collective):
    the ranks agree after each stage, since a rank that ran the self-check's kernel alone would
    wait at its barrier for peers that never come."""
    reducer, reason = None, ""
    try:
        reducer = SymmetricAllReduce(group, device, max_bytes)
    except Exception as exc:  # noqa: BLE001 — any failure means: use NCCL
        reason = f"{type(exc).__name__}: {exc}"
    if all_ranks(reducer is not None):
        assert reducer is not None  # this rank is among all of them
        try:
            _self_check(reducer, group, device)
        except Exception as exc:  # noqa: BLE001
            reducer, reason = None, f"{type(exc).__name__}: {exc}"
        if all_ranks(reducer is not None):
            return reducer
    log.warning("symmetric-memory all-reduce off, NCCL does every sum (%s)",
                reason or "another rank could not set it up")
    return None


def _self_check(reducer: SymmetricAllReduce, group: dist.ProcessGroup,
                device: torch.device) -> None:
    """One real sum before it is trusted: peers mapped, barrier working, the arithmetic right."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    x = torch.full((8, 64), float(rank + 1), dtype=torch.float32, device=device)
    total = reducer(x)
    expected = size * (size + 1) / 2
    if not bool((total == expected).all()):
        raise RuntimeError(f"self-check sum gave {total.flatten()[0].item()}, "
                           f"expected {expected}")
