"""Triton kernels that fuse a decoder layer's small elementwise steps: residual-add + RMSNorm,
rotary on q and k in place, and SiLU(gate) * up.

In a batch-1 decode step each of these is a handful of 1-2 µs PyTorch kernels (RMSNorm alone is
seven); here each is one launch. They round where HF's PyTorch code rounds: every intermediate
that HF holds in the activation dtype is cast to it here too, everything else is float32.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # rows of N elements; row r is (token r // num_heads, head r % num_heads)
    residual_ptr,  # (T, N) when HAS_RESIDUAL
    weight_ptr,  # (N,)
    out_ptr,  # (T * num_heads, N), contiguous
    residual_out_ptr,  # (T, N), contiguous, when HAS_RESIDUAL
    stride_xt,
    stride_xh,
    stride_rt,
    num_heads,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,  # N padded to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    token, head = row // num_heads, row % num_heads
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + token * stride_xt + head * stride_xh + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * stride_rt + offs, mask=mask, other=0.0)
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
    x3 = x if x.dim() == 3 else x[:, None, :]  # (T, heads, N): heads is 1 for hidden states
    num_tokens, num_heads, n = x3.shape
    assert x3.stride(2) == 1, "the normed dimension must be the innermost one"
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = None
    if residual is not None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens * num_heads == 0:
        return out, residual_out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1 and x.dim() == 2
    _rms_norm_kernel[(num_tokens * num_heads,)](
        x3,
        residual if residual is not None else x3,
        weight,
        out,
        residual_out if residual is not None else out,
        x3.stride(0),
        x3.stride(1),
        residual.stride(0) if residual is not None else 0,
        num_heads,
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=triton.next_power_of_2(n),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x: (T, N) hidden states or (T, heads, N) heads (Qwen3's
    q_norm / k_norm), any strides with the last one 1. Returns a new contiguous tensor."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: (T, N) → (RMSNorm(x + residual), x + residual), both new tensors."""
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def _rotate_heads(
    base_ptr, stride_h, num_heads, cos, sin, offs_d, HALF: tl.constexpr, BLOCK_H: tl.constexpr
):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & (offs_d[None, :] < HALF)
    first = base_ptr + heads[:, None] * stride_h + offs_d[None, :]  # (BLOCK_H, BLOCK_D)
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1)
    tl.store(first, (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # (T, q_heads, head_dim), last stride 1
    k_ptr,  # (T, k_heads, head_dim), last stride 1
    cos_ptr,  # (T, head_dim): both halves equal, only the first is read
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_D: tl.constexpr,  # HALF padded to a power of two
    BLOCK_H: tl.constexpr,  # max(q_heads, k_heads) padded to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + token * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]  # (1, BLOCK_D): the same for every head
    q_row, k_row = q_ptr + token * stride_qt, k_ptr + token * stride_kt
    _rotate_heads(q_row, stride_qh, num_q_heads, cos, sin, offs_d, HALF, BLOCK_H)
    _rotate_heads(k_row, stride_kh, num_k_heads, cos, sin, offs_d, HALF, BLOCK_H)


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox-style rotary (HF ``rotate_half``) on q (T, heads, head_dim) and k (T, kv_heads,
    head_dim) in place, e.g. strided views of the fused qkv output; cos, sin: (T, head_dim)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert head_dim % 2 == 0 and k.shape[0] == num_tokens and cos.shape == (num_tokens, head_dim)
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_q_heads,
        num_k_heads,
        HALF=half,
        BLOCK_D=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_k_heads)),
    )


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # (T, 2 * N): gate in the first half of a row, up in the second
    out_ptr,  # (T, N), contiguous
    stride_gt,
    N,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = gate_up_ptr + token * stride_gt
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + N + offs, mask=mask, other=0.0).to(tl.float32)
    # HF rounds silu(gate) to the activation dtype before the product
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * N + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 * N) merged gate/up projection → SiLU(gate) * up, (T, N)."""
    num_tokens, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(1) == 1
    n = width // 2
    out = torch.empty((num_tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(n, SILU_BLOCK))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), n, BLOCK=SILU_BLOCK)
    return out
