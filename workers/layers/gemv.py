"""Matrix-vector products for decode steps of one token, with the layer's small steps fused in.

At batch 1 a decode step is memory-bound: each projection reads its weight once and does two
flops per weight. cuBLAS picks GEMM tiles for M = 1 that leave the smaller matrices well below
bandwidth (qkv and o of Llama-3.2-1B at ~2 TB/s of the H200's ~4), and the steps around them —
residual add + RMSNorm before qkv and gate_up, SiLU(gate) * up after gate_up — are separate
launches of ~2 µs each, a third of a layer's time. Here one kernel does all of a projection:

    out = epilogue(W @ prologue(x))

- prologue: nothing, or RMSNorm(x [+ residual]): every program recomputes the row's inverse RMS
  from the whole row (a few KB, read from L2) and normalizes each chunk as it streams the
  weight; program 0 also writes x + residual, the residual stream for the layer after.
- epilogue: nothing, or SiLU(gate) * up: a program reads the gate rows and the matching up rows
  of a merged gate_up weight and writes their product.

``qkv_rotary_store`` goes further for the attention input: after the norm and the qkv rows it
applies rotary to q and k and writes k and v into the paged cache itself, so a layer's
attention needs no rotary or store launch (models without per-head q/k norms).

Intermediate values are rounded to the activation dtype where the unfused layers round them
(fused_kernels.py), so the two paths agree as far as summation order allows.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _normalized_chunk(
    x_ptr, residual_ptr, norm_weight_ptr, offs, mask, rstd,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """x[offs] as the projection sees it: (x + residual), normalized and scaled when NORM."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the residual add rounds to the activation dtype, as HF's does
        x = (x.to(tl.float32) + tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
    if NORM:
        normed = (x.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(norm_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = (weight * normed).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _inverse_rms(
    x_ptr, residual_ptr, residual_out_ptr, K, eps, WRITE_RESIDUAL,
    HAS_RESIDUAL: tl.constexpr, ROW_BLOCK: tl.constexpr,
):  # fmt: skip
    """1 / RMS(x [+ residual]) over the whole row; writes x + residual when WRITE_RESIDUAL."""
    offs = tl.arange(0, ROW_BLOCK)
    in_k = offs < K
    row = tl.load(x_ptr + offs, mask=in_k, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offs, mask=in_k, other=0.0)
        row = (row.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if WRITE_RESIDUAL:
            tl.store(residual_out_ptr + offs, row, mask=in_k)
    row_f32 = row.to(tl.float32)
    return tl.rsqrt(tl.sum(row_f32 * row_f32, axis=0) / K + eps)


@triton.jit
def _norm_and_project(
    x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, w_rows, row_mask, pair_offset, K,
    eps, write_residual,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PAIRED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """(W[rows] @ prologue(x), W[rows + pair offset] @ prologue(x) when PAIRED) in float32;
    w_rows: (BLOCK_N, 1) pointers to the rows' starts.

    The chunks' loads are software-pipelined, NUM_STAGES - 1 chunks requested ahead of the one
    summed (asynchronous copies into shared memory): without it a program has one chunk in
    flight at a time, and an SM's few programs cannot keep enough bytes in flight to cover the
    memory latency (Triton pipelines plain loads only in a tl.range that asks for stages).
    The norm's pass over the row runs inside the first step, after the pipeline's prologue has
    requested the first chunks: the weights do not depend on it, so its latency hides behind
    theirs instead of coming before them."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_pair = tl.zeros((BLOCK_N,), dtype=tl.float32)
    rstd = 0.0
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if NORM:  # noqa: SIM102 — a constexpr: kernels without a norm compile no pass
            if k0 == 0:
                rstd = _inverse_rms(x_ptr, residual_ptr, residual_out_ptr, K, eps,
                                    write_residual, HAS_RESIDUAL, ROW_BLOCK)
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        x = _normalized_chunk(
            x_ptr, residual_ptr, norm_weight_ptr, offs, mask, rstd, NORM, HAS_RESIDUAL
        )
        w_mask = row_mask[:, None] & mask[None, :]
        w = tl.load(w_rows + offs[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if PAIRED:
            w = tl.load(w_rows + pair_offset + offs[None, :], mask=w_mask, other=0.0,
                        eviction_policy="evict_first")
            acc_pair += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return acc, acc_pair


@triton.jit
def _gemv_kernel(
    x_ptr,  # (K,) the input row
    residual_ptr,  # (K,) added to x before the norm, when HAS_RESIDUAL
    norm_weight_ptr,  # (K,) when NORM
    residual_out_ptr,  # (K,) x + residual, written by program 0 when HAS_RESIDUAL
    w_ptr,  # (rows, K), row stride stride_w; with SILU_MUL the up rows start at row N
    bias_ptr,  # (rows,) when HAS_BIAS
    out_ptr,  # (N,)
    N,  # outputs
    K,
    stride_w,
    eps,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,  # K padded to a power of two: the norm's first pass in one load
    NUM_STAGES: tl.constexpr,  # weight chunks in flight at once, + 1 (_project_rows)
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc, acc_up = _norm_and_project(x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr,
                                    w_rows, row_mask, N * stride_w, K, eps, pid == 0, NORM,
                                    HAS_RESIDUAL, SILU_MUL, BLOCK_N, BLOCK_K, ROW_BLOCK,
                                    NUM_STAGES)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N + rows, mask=row_mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        # as the unfused path: gate and up rounded as gate_up's output, silu(gate) rounded
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(dtype), mask=row_mask)


@triton.jit
def _qkv_rotary_kernel(
    x_ptr,  # (K,) the layer's input row
    residual_ptr,  # (K,) when HAS_RESIDUAL
    norm_weight_ptr,  # (K,) the input RMSNorm's weight
    residual_out_ptr,  # (K,) x + residual, written by program 0 when HAS_RESIDUAL
    w_ptr,  # ((heads + 2 * kv_heads) * HEAD_DIM, K): q heads, then k heads, then v heads
    bias_ptr,  # (rows,) when HAS_BIAS
    cos_ptr,  # (HEAD_DIM,) this token's rotary cos; both halves equal, the first is read
    sin_ptr,
    q_out_ptr,  # (heads * HEAD_DIM,)
    k_cache_ptr,  # (slots, kv_heads, HEAD_DIM), contiguous
    v_cache_ptr,
    slot_ptr,  # (1,) int64: the token's cache slot, below zero for a padding token
    K,
    stride_w,
    eps,
    num_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rotary pairs a program: BLOCK_N rows from each half of one head
    BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """qkv = W @ RMSNorm(x [+ residual]), then rotary on q and k (neox: element i of a head
    turns with element i + HEAD_DIM / 2, so a program takes rows from both halves), q to
    q_out and k, v straight into the paged cache."""
    HALF: tl.constexpr = HEAD_DIM // 2
    CHUNKS: tl.constexpr = HALF // BLOCK_N
    pid = tl.program_id(0)
    head = pid // CHUNKS
    pair = (pid % CHUNKS) * BLOCK_N + tl.arange(0, BLOCK_N)  # offsets in the first half
    rows = head * HEAD_DIM + pair
    row_mask = pair < HALF
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    first, second = _norm_and_project(x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr,
                                      w_rows, row_mask, HALF * stride_w, K, eps, pid == 0, True,
                                      HAS_RESIDUAL, True, BLOCK_N, BLOCK_K, ROW_BLOCK,
                                      NUM_STAGES)
    if HAS_BIAS:
        first += tl.load(bias_ptr + rows).to(tl.float32)
        second += tl.load(bias_ptr + rows + HALF).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    # rounded as the unfused qkv output, then turned in float32 as the rotary kernel does
    first, second = first.to(dtype).to(tl.float32), second.to(dtype).to(tl.float32)
    if head < num_heads + num_kv_heads:  # q or k: rotary
        cos = tl.load(cos_ptr + pair).to(tl.float32)
        sin = tl.load(sin_ptr + pair).to(tl.float32)
        first, second = first * cos - second * sin, second * cos + first * sin
    first, second = first.to(dtype), second.to(dtype)
    if head < num_heads:
        tl.store(q_out_ptr + rows, first)
        tl.store(q_out_ptr + rows + HALF, second)
    else:
        slot = tl.load(slot_ptr).to(tl.int64)
        if slot >= 0:
            slot_row = slot * num_kv_heads * HEAD_DIM + pair
            if head < num_heads + num_kv_heads:
                k_row = k_cache_ptr + slot_row + (head - num_heads) * HEAD_DIM
                tl.store(k_row, first.to(k_cache_ptr.dtype.element_ty))
                tl.store(k_row + HALF, second.to(k_cache_ptr.dtype.element_ty))
            else:
                v_row = v_cache_ptr + slot_row + (head - num_heads - num_kv_heads) * HEAD_DIM
                tl.store(v_row, first.to(v_cache_ptr.dtype.element_ty))
                tl.store(v_row + HALF, second.to(v_cache_ptr.dtype.element_ty))


def default_config(
    num_outputs: int, k: int, silu_mul: bool, itemsize: int = 2
) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from `python -m tools.kernels.tune_gemv` on
    an H200 with the chunk loads pipelined, bf16: a few rows a program (hundreds of programs, so
    every SM has loads in flight from the start), 4 warps and 2 chunks requested ahead. gate_up
    (two rows an output) streams best in short chunks of more rows; the other projections in
    long chunks, shorter where a narrow input feeds many rows. Wider weights (``itemsize``
    bytes) take proportionally shorter chunks: the same bytes in flight, and the same shared
    memory (under 48 KB a program), which GPUs with less of it than the H200 also have."""
    if silu_mul:
        block_n, block_k = (16 if num_outputs >= 4096 else 8), 256
    else:
        block_n, block_k = 8, (512 if k <= 2048 and num_outputs >= 3072 else 1024)
    block_k = max(32, block_k * 2 // itemsize)
    return block_n, min(block_k, triton.next_power_of_2(k)), 4, 3


def check_one_row(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"{what} takes one row, got input of shape {tuple(x.shape)}")


def gemv(
    x: torch.Tensor,  # (1, K)
    weight: torch.Tensor,  # (N, K), or (2N, K) gate rows then up rows with silu_mul
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,  # (1, K)
    norm_weight: torch.Tensor | None = None,  # (K,)
    eps: float = 0.0,
    silu_mul: bool = False,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, new residual): out = W @ x with the optional prologue and epilogue of the module
    docstring; the new residual is x + residual when one was given, else None.

    x is a single row: the caller takes this path only for decode steps of one sequence.
    """
    check_one_row(x, "gemv")
    k = x.shape[1]
    rows, weight_k = weight.shape
    if weight_k != k or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not take inputs of size {k}")
    if residual is not None and norm_weight is None:
        raise ValueError("a residual is only added before a norm")
    if silu_mul and rows % 2:
        raise ValueError(f"silu_mul needs gate and up rows, got {rows} rows")
    n = rows // 2 if silu_mul else rows
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    block_n, block_k, num_warps, num_stages = config or default_config(n, k, silu_mul,
                                                                       weight.element_size())
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual.contiguous() if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        residual_out if residual_out is not None else x,
        weight,
        bias if bias is not None else x,
        out,
        n,
        k,
        weight.stride(0),
        eps,
        NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROW_BLOCK=triton.next_power_of_2(k),
        NUM_STAGES=num_stages,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, residual_out


def qkv_rotary_store(
    x: torch.Tensor,  # (1, K)
    weight: torch.Tensor,  # ((heads + 2 * kv_heads) * head_dim, K)
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,  # (1, K); None at the first layer
    norm_weight: torch.Tensor,  # (K,)
    eps: float,
    cos: torch.Tensor,  # (1, head_dim)
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (1,) int64
    num_heads: int,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's attention input for one sequence in one kernel: (q (1, heads, head_dim)
    after rotary, the new residual); k and v, rotary applied to k, are written into the cache
    at the token's slot. The unfused equivalent: add_rms_norm, the qkv matmul and
    attention_input (rotary and the K/V store)."""
    check_one_row(x, "qkv_rotary_store")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = x.shape[1]
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if weight.shape != (rows, k) or weight.stride(1) != 1:
        raise ValueError(f"qkv weight {tuple(weight.shape)} is not ({rows}, {k})")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    if cos.shape != (1, head_dim) or sin.shape != (1, head_dim) or slot_mapping.shape != (1,):
        raise ValueError("cos, sin and slot_mapping must be one token's")
    block_n, block_k, num_warps, num_stages = config or default_config(rows, k, False,
                                                                       weight.element_size())
    pairs = max(1, block_n // 2)  # a program takes `pairs` rows from each half of a head
    if (head_dim // 2) % pairs:
        raise ValueError(f"head_dim {head_dim} does not split into programs of {pairs} pairs")
    x = x.contiguous()
    q = torch.empty((1, num_heads, head_dim), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    grid = ((num_heads + 2 * num_kv_heads) * (head_dim // 2 // pairs),)
    _qkv_rotary_kernel[grid](
        x,
        residual.contiguous() if residual is not None else x,
        norm_weight,
        residual_out,
        weight,
        bias if bias is not None else x,
        cos.contiguous(),
        sin.contiguous(),
        q,
        k_cache,
        v_cache,
        slot_mapping,
        k,
        weight.stride(0),
        eps,
        num_heads,
        num_kv_heads,
        HEAD_DIM=head_dim,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=pairs,
        BLOCK_K=block_k,
        ROW_BLOCK=triton.next_power_of_2(k),
        NUM_STAGES=num_stages,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return q, residual_out
