"""A one-token decode step's MLP in one persistent launch — an experiment, timed against the
two launches of gemv.py by `python -m workers.layers.tune_gemv --mlp`; no model uses it yet.

gemv.py runs the MLP as two launches: gate_up (the norm before it, SiLU * up after) and down.
Each ramps from nothing to full bandwidth, and on the H200 at Llama-3.2-1B's sizes that ramp
is a large share of the time (down: 14.4 µs for 33.6 MB, 2.3 TB/s). Here one launch does both,
with a grid-wide barrier between them. The down weight does not depend on the activation, so
every program, once it has arrived at the barrier, requests its first tile of down *before* it
waits there: those reads are in flight while the last programs finish gate_up, and after the
barrier only the activation (16 KB, read from L2) stands between a program and its sums.

The barrier needs every program resident at once, so the grid is one program per SM. It is one
int64 counter that only grows: each of a launch's programs adds one, and the launch's target is
the next multiple of the grid size above the count it found, so the counter needs no reset
between launches or CUDA graph replays. A program that waits more than MAX_SPINS reads gives up
and raises an error flag instead of hanging the GPU (``barrier_missed``).

Under the interpreter the programs run one after another, so a barrier would wait for ever:
there the two phases run as two launches of the same kernel, with the same arithmetic.
"""

import os

import torch
import triton
import triton.language as tl

from workers.layers.gemv import _inverse_rms, _project_rows, check_one_row

MAX_SPINS = 1 << 22  # counter reads before giving up: about a second
GATE_UP, DOWN, BOTH = 1, 2, 3  # the phases a launch runs


@triton.jit
def _grid_arrive(barrier_ptr, programs):
    """This program's arrival at the barrier (what it stored before is released to every
    program that sees the count); returns the count at which all of the launch have come.
    barrier_ptr: (count, error flag), int64."""
    tl.debug_barrier()  # every thread's stores come before the release below
    arrived = tl.atomic_add(barrier_ptr, 1, sem="release", scope="gpu")
    return (arrived // programs + 1) * programs


@triton.jit
def _grid_wait(barrier_ptr, target, MAX_SPINS: tl.constexpr):
    """Waits until the count reaches target (acquire: the others' stores are then visible)."""
    count = tl.atomic_add(barrier_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (count < target) & (spins < MAX_SPINS):
        count = tl.atomic_add(barrier_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if count < target:  # a program never came (not resident?): say so, do not hang
        tl.atomic_xchg(barrier_ptr + 1, 1)
    tl.debug_barrier()


@triton.jit
def _gate_up_phase(
    x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, gate_up_ptr, act_ptr, hidden,
    inter, stride_gate_up, eps, pid, programs,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):  # fmt: skip
    """act = SiLU(gate) * up of RMSNorm(x [+ residual]), rounded as gemv's epilogue rounds."""
    rstd = _inverse_rms(x_ptr, residual_ptr, residual_out_ptr, hidden, eps, pid == 0,
                        HAS_RESIDUAL, ROW_BLOCK)
    dtype = act_ptr.dtype.element_ty
    for block in range(pid, tl.cdiv(inter, BLOCK_N), programs):
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < inter
        w_rows = gate_up_ptr + rows.to(tl.int64)[:, None] * stride_gate_up
        gate, up = _project_rows(x_ptr, residual_ptr, norm_weight_ptr, w_rows, row_mask,
                                 inter * stride_gate_up, hidden, rstd, True, HAS_RESIDUAL, True,
                                 BLOCK_N, BLOCK_K)
        gate = gate.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(act_ptr + rows, (silu * up.to(dtype).to(tl.float32)).to(dtype), mask=row_mask)


@triton.jit
def _persistent_mlp_kernel(
    x_ptr,  # (hidden,) the MLP's input row (before the post-attention norm)
    residual_ptr,  # (hidden,) added to x before the norm, when HAS_RESIDUAL
    norm_weight_ptr,  # (hidden,)
    residual_out_ptr,  # (hidden,) x + residual, written by program 0 when HAS_RESIDUAL
    gate_up_ptr,  # (2 inter, hidden): gate rows, then up rows
    down_ptr,  # (hidden, inter)
    act_ptr,  # (inter,) scratch: SiLU(gate) * up, written in phase 1, read by every program in 2
    out_ptr,  # (hidden,)
    barrier_ptr,  # (2,) int64: arrivals over every launch, error flag
    hidden,
    inter,
    stride_gate_up,
    stride_down,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    PHASES: tl.constexpr,  # GATE_UP, DOWN, or BOTH with the barrier between
    BLOCK_N_UP: tl.constexpr,
    BLOCK_K_UP: tl.constexpr,
    BLOCK_N_DOWN: tl.constexpr,
    BLOCK_K_DOWN: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    MAX_SPINS: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if PHASES & 1:
        _gate_up_phase(x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, gate_up_ptr,
                       act_ptr, hidden, inter, stride_gate_up, eps, pid, programs, HAS_RESIDUAL,
                       BLOCK_N_UP, BLOCK_K_UP, ROW_BLOCK)
    if PHASES & 2:
        target = 0
        if PHASES == 3:
            target = _grid_arrive(barrier_ptr, programs)
        # the first tile of this program's first rows of down, requested between arriving
        # and waiting: the release above does not hold it back, and the wait overlaps it
        k_offs = tl.arange(0, BLOCK_K_DOWN)
        first_rows = pid * BLOCK_N_DOWN + tl.arange(0, BLOCK_N_DOWN)
        first_mask = (first_rows < hidden)[:, None] & (k_offs < inter)[None, :]
        first_tile = tl.load(down_ptr + first_rows.to(tl.int64)[:, None] * stride_down
                             + k_offs[None, :], mask=first_mask, other=0.0,
                             eviction_policy="evict_first")
        if PHASES == 3:
            _grid_wait(barrier_ptr, target, MAX_SPINS)
        for block in range(pid, tl.cdiv(hidden, BLOCK_N_DOWN), programs):
            rows = block * BLOCK_N_DOWN + tl.arange(0, BLOCK_N_DOWN)
            row_mask = rows < hidden
            w_rows = down_ptr + rows.to(tl.int64)[:, None] * stride_down
            acc = tl.zeros((BLOCK_N_DOWN,), dtype=tl.float32)
            k_start = 0
            if block == pid:  # the prefetched tile is this block's first chunk
                # .cg: the activation comes from L2, where the other SMs' stores landed (this
                # SM's L1 may hold the previous launch's)
                act = tl.load(act_ptr + k_offs, mask=k_offs < inter, other=0.0,
                              cache_modifier=".cg")
                acc += tl.sum(first_tile.to(tl.float32) * act.to(tl.float32)[None, :], axis=1)
                k_start = BLOCK_K_DOWN
            for k0 in range(k_start, inter, BLOCK_K_DOWN):
                offs = k0 + k_offs
                mask = offs < inter
                act = tl.load(act_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                w = tl.load(w_rows + offs[None, :], mask=row_mask[:, None] & mask[None, :],
                            other=0.0, eviction_policy="evict_first")
                acc += tl.sum(w.to(tl.float32) * act.to(tl.float32)[None, :], axis=1)
            tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


def new_barrier(device: torch.device) -> torch.Tensor:
    """The barrier's state for every launch on one device: (arrivals, error flag)."""
    return torch.zeros(2, dtype=torch.int64, device=device)


def barrier_missed(barrier: torch.Tensor) -> bool:
    return bool(barrier[1].item())


def default_programs(device: torch.device) -> int:
    """One program per SM: all resident at once, as the barrier needs."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_mlp(
    x: torch.Tensor,  # (1, H)
    gate_up: torch.Tensor,  # (2 I, H)
    down: torch.Tensor,  # (H, I)
    residual: torch.Tensor | None,  # (1, H); None at a layer without one
    norm_weight: torch.Tensor,  # (H,)
    eps: float,
    barrier: torch.Tensor,  # from new_barrier, on x's device
    *,
    programs: int | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(SiLU(gate) * up of RMSNorm(x + residual)), x + residual (x without a residual)),
    as gemv's two launches compute them. ``config``: (BLOCK_N_UP, BLOCK_K_UP, BLOCK_N_DOWN,
    BLOCK_K_DOWN, num_warps)."""
    check_one_row(x, "persistent_mlp")
    hidden, inter = x.shape[1], down.shape[1]
    if gate_up.shape != (2 * inter, hidden) or down.shape != (hidden, inter):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not "
                         f"make an MLP of hidden size {hidden}")
    if gate_up.stride(1) != 1 or down.stride(1) != 1:
        raise ValueError("the weights' rows must be contiguous")
    if barrier.shape != (2,) or barrier.dtype != torch.int64 or barrier.device != x.device:
        raise ValueError("barrier must come from new_barrier on the input's device")
    block_n_up, block_k_up, block_n_down, block_k_down, num_warps = config or (
        4, min(1024, triton.next_power_of_2(hidden)), 8, min(1024, triton.next_power_of_2(inter)),
        8)
    x = x.contiguous()
    act = torch.empty((inter,), dtype=x.dtype, device=x.device)
    out = torch.empty((1, hidden), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    args = (x, residual.contiguous() if residual is not None else x, norm_weight, residual_out,
            gate_up, down, act, out, barrier, hidden, inter, gate_up.stride(0), down.stride(0),
            eps)
    grid = (programs or default_programs(x.device),)
    # programs run one after another in the interpreter: the phases as two launches there
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    for phases in (GATE_UP, DOWN) if interpreted else (BOTH,):
        _persistent_mlp_kernel[grid](
            *args, HAS_RESIDUAL=residual is not None, PHASES=phases, BLOCK_N_UP=block_n_up,
            BLOCK_K_UP=block_k_up, BLOCK_N_DOWN=block_n_down, BLOCK_K_DOWN=block_k_down,
            ROW_BLOCK=triton.next_power_of_2(hidden), MAX_SPINS=MAX_SPINS, num_warps=num_warps,
            num_stages=3,
        )  # fmt: skip
    return out, residual_out
