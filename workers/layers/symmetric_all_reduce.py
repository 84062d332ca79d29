"""All-reduce through peer GPU memory, for the small sums of decode steps.

A decode step of a tensor-parallel model all-reduces two hidden-state rows per layer (attention
and MLP outputs): 8 KB at batch 1 for an 8B model, 65 times a step. Inside a CUDA graph NCCL
takes ~21 µs for each (tools/profile/all_reduce.py, two H200s). Here every rank of the group
maps one buffer of every other rank (PyTorch symmetric memory over NVLink) and one kernel does
the sum, with one of two kernels (the engine's ``peer_sum_kernel``):

- ``push`` (the default, push_all_reduce.py): each rank writes its input into every rank's
  buffer and raises a flag there; a rank sums once its peers' flags are up. One one-way trip.
- ``one_shot``: PyTorch's ``symm_mem::one_shot_all_reduce_copy``: the copy-in, a barrier, the
  peer reads and a closing barrier in one launch (6.5 µs for 8 KB); two round trips.

Only peer pointers are used, never NVLink multicast (``multimem``). Tensors larger than
``max_bytes``, other dtypes and CPU tensors go to NCCL.
"""

import logging
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 20  # decode batches up to 256 rows of 8192 bf16 values
KERNELS = ("push", "one_shot")
# PyTorch's one-shot kernel is compiled for these dtypes only (no float16)
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)


class SymmetricAllReduce:
    def __init__(self, group: dist.ProcessGroup, device: torch.device,
                 max_bytes: int = DEFAULT_MAX_BYTES, kernel: str = "push") -> None:
        # The process must not create NVLink multicast objects at the rendezvous: its start-up
        # sets TORCH_SYMM_MEM_DISABLE_MULTICAST (cluster/environment.py)
        if kernel not in KERNELS:
            raise ValueError(f"the peer-memory sum kernel must be one of {', '.join(KERNELS)}, "
                             f"got {kernel!r}")
        import torch.distributed._symmetric_memory as symm_mem

        # Triton only here, on GPUs: a CPU install may have none
        from workers.layers.push_all_reduce import FLAGS_BYTES, buffer_bytes, new_counters

        self.kernel = kernel
        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.rank = dist.get_rank(group)
        if hasattr(symm_mem, "get_backend") and symm_mem.get_backend(device) is None:
            symm_mem.set_backend("CUDA")  # peer pointers through the CUDA driver, not NVSHMEM
        with warnings.catch_warnings():  # needed by older PyTorch; a deprecated no-op in 2.11
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        world = dist.get_world_size(group)
        self.buffer = symm_mem.empty(buffer_bytes(world, max_bytes), dtype=torch.uint8,
                                     device=device)
        self.buffer[:FLAGS_BYTES].zero_()  # no flag raised yet
        handle = symm_mem.rendezvous(self.buffer, group)  # collective: every rank maps every buffer
        self.buffer_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.uses = new_counters(device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's flags are zero before any rank raises one

    def fits(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        dtype_ok = self.kernel == "push" or t.dtype in ONE_SHOT_DTYPES
        return (t.is_cuda and dtype_ok and t.is_contiguous()
                and 0 < nbytes <= self.max_bytes and nbytes % 4 == 0)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of t over the group, in a new tensor (t is left as it was)."""
        if self.kernel == "push":
            from workers.layers.push_all_reduce import push_all_reduce

            return push_all_reduce(t, self.buffer_ptrs, self.uses, self.rank, self.max_bytes)
        # one_shot: the whole buffer is its staging area (the push kernel's flags are unused)
        staging = self.buffer.view(t.dtype)[: t.numel()].view(t.shape)
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):  # PyTorch < 2.9
            staging.copy_(t)
            return torch.ops.symm_mem.one_shot_all_reduce(staging, "sum", self.group_name)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, t, "sum", self.group_name)

    def peer_missed(self) -> bool:
        """Whether a push sum ever gave up waiting for a peer (its result was then wrong)."""
        return self.kernel == "push" and bool(self.uses[-1].item())


def make_symmetric_all_reduce(group: dist.ProcessGroup, device: torch.device,
                              all_ranks: Callable[[bool], bool],
                              max_bytes: int = DEFAULT_MAX_BYTES,
                              kernel: str = "push") -> SymmetricAllReduce | None:
    """A SymmetricAllReduce if every rank of the group could set one up, else None and NCCL
    does every sum. ``all_ranks(flag)`` tells whether flag holds on every rank (a collective):
    the ranks agree after each stage, since a rank that ran the self-check's kernel alone would
    wait at its barrier for peers that never come."""
    reducer, reason = None, ""
    try:
        reducer = SymmetricAllReduce(group, device, max_bytes, kernel)
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
    if reducer.peer_missed():
        raise RuntimeError("self-check sum: a peer's flag never came")
    if not bool((total == expected).all()):
        raise RuntimeError(f"self-check sum gave {total.flatten()[0].item()}, "
                           f"expected {expected}")
