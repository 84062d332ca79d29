"""Triton kernels that fuse a decoder layer's small elementwise steps: residual-add + RMSNorm
and SiLU(gate) * up (the attention input's norms, rotary and K/V store: attention_input.py).

In a batch-1 decode step each of these is a handful of 1-2 µs PyTorch kernels (RMSNorm alone is
seven); here each is one launch. They round where HF's PyTorch code rounds: every intermediate
that HF holds in the activation dtype is cast to it here too, everything else is float32.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (T, N), row stride stride_xt
    residual_ptr,  # (T, N) when HAS_RESIDUAL, row stride stride_rt
    weight_ptr,  # (N,)
    out_ptr,  # (T, N), contiguous
    residual_out_ptr,  # (T, N), contiguous, when HAS_RESIDUAL
    stride_xt,
    stride_rt,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,  # N padded to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_rt + offs, mask=mask, other=0.0)
        # HF adds the residual in the activation dtype
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * N + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(x, residual, weight, eps):
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"RMSNorm takes rows (T, N) with the last stride 1, got {tuple(x.shape)}")
    num_tokens, n = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.stride(1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} does not match {tuple(x.shape)}")
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out, residual_out
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=triton.next_power_of_2(n),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x (T, N), any row stride. Returns a new contiguous tensor."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: (T, N) → (RMSNorm(x + residual), x + residual), both new tensors."""
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def inverse_rms_of_row(row_ptr, size, eps, BLOCK: tl.constexpr):
    """1 / RMS of size values at row_ptr (BLOCK: size padded to a power of two), as RMSNorm
    takes it: for kernels scaling the output of a projection whose norm weight is folded."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(row_ptr + offs, mask=offs < size, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / size + eps)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # (T, 2 * N): gate in the first half of a row, up in the second
    out_ptr,  # (T, N), contiguous
    scale_rows_ptr,  # (T, scale_size), row stride stride_st, when ROW_SCALE
    stride_gt,
    stride_st,
    N,
    scale_size,
    scale_eps,
    ROW_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,  # scale_size padded to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = gate_up_ptr + token * stride_gt
    gate = tl.load(row + offs, mask=mask, other=0.0)
    up = tl.load(row + N + offs, mask=mask, other=0.0)
    if ROW_SCALE:
        # gate_up took the layer's input before its RMSNorm (weights folded): scale each value
        # by the row's 1 / RMS and round, as the projection of the normed row would have
        rstd = inverse_rms_of_row(scale_rows_ptr + token * stride_st, scale_size, scale_eps,
                                  BLOCK_S)
        gate = (gate.to(tl.float32) * rstd).to(gate_up_ptr.dtype.element_ty)
        up = (up.to(tl.float32) * rstd).to(gate_up_ptr.dtype.element_ty)
    gate, up = gate.to(tl.float32), up.to(tl.float32)
    # HF rounds silu(gate) to the activation dtype before the product
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * N + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(
    gate_up: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None
) -> torch.Tensor:
    """(T, 2 * N) merged gate/up projection → SiLU(gate) * up, (T, N).

    row_scale (rows (T, hidden), eps): gate and up are first multiplied by 1 / RMS of the
    token's row of rows, for a gate_up projection that took the layer's input before its
    RMSNorm (LlamaModel.fold_norm_weights)."""
    num_tokens, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(1) == 1
    n = width // 2
    scale_rows, scale_eps = row_scale if row_scale is not None else (gate_up, 0.0)
    if scale_rows.dim() != 2 or scale_rows.shape[0] != num_tokens or scale_rows.stride(1) != 1:
        raise ValueError(f"row_scale's rows must be ({num_tokens}, hidden) with the last stride "
                         f"1, got {tuple(scale_rows.shape)}")
    out = torch.empty((num_tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    # with a row scale each program reads its token's input row again (from L2): one program
    # a token instead was slower at decode batches (2.8 against 1.6 µs a layer, H200)
    grid = (num_tokens, triton.cdiv(n, SILU_BLOCK))
    _silu_and_mul_kernel[grid](
        gate_up, out, scale_rows, gate_up.stride(0), scale_rows.stride(0), n,
        scale_rows.shape[1], scale_eps, ROW_SCALE=row_scale is not None, BLOCK=SILU_BLOCK,
        BLOCK_S=triton.next_power_of_2(scale_rows.shape[1]) if row_scale is not None else 1,
    )  # fmt: skip
    return out
