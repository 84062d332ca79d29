"""Triton paged prefill / extend attention: any number of new tokens per sequence.

Covers a whole prompt, a chunk of one, new tokens after a prefix hit, and decode rows
(q_len == 1) mixed into the same batch. store_kv has already written the new tokens' K/V into
the cache, so every key is read from the paged cache through the block table.

One program per (sequence, query block, kv head). Its tile's M rows are BLOCK_Q new tokens
times the GROUP query heads sharing the kv head, so each K/V row is loaded once per group::

    row r of the tile:  token q_block * BLOCK_Q + r // GROUP,  head kv_head * GROUP + r % GROUP
    token j's position:  seq_len - q_len + j        (it sees keys at positions <= it)

The program walks the context from position 0 up to its last token's position with an online
softmax: first the keys every row of its tile sees (no mask), then the few steps along the
diagonal with the causal mask. Programs whose query block lies past their sequence's q_len
exit at once, so the grid can be sized by ``max_query_len`` alone; the grid runs the last
query blocks (the longest walks) first, so that short programs fill the tail.

A quantized cache (int8 or e4m3 with ``k_scale``/``v_scale``) is dequantized in registers
as each step loads it, the way decode does (workers/attention/triton_decode.py).
"""

import torch
import triton
import triton.language as tl

from workers.attention.triton_quant import check_scales, conversion, dot_dtype, load_rows


@triton.jit
def _attend_keys(
    q, acc, row_sum, row_max, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table,
    n_start, offs_n, offs_d, d_mask, q_pos, end, kv_head, scale_log2, stride_cache_block,
    stride_cache_slot, stride_cache_head, stride_scale_block, stride_scale_slot,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
    QUANTIZED: tl.constexpr, CONVERT: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over the keys at positions n_start + offs_n: the new (acc,
    row_sum, row_max). MASKED: some keys lie past end or past a row's own position."""
    pos = n_start + offs_n
    n_mask = pos < end
    if MASKED:
        page = tl.load(block_table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        page = tl.load(block_table + pos // PAGE_SIZE).to(tl.int64)
    rows = page * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_slot
    kv_offs = rows[:, None] + kv_head * stride_cache_head + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :] if MASKED else d_mask[None, :]
    scale_offs = page * stride_scale_block + (pos % PAGE_SIZE) * stride_scale_slot + kv_head
    k = load_rows(k_cache_ptr, k_scale_ptr, kv_offs, kv_mask, scale_offs, n_mask, q.dtype,
                  QUANTIZED, CONVERT)
    v = load_rows(v_cache_ptr, v_scale_ptr, kv_offs, kv_mask, scale_offs, n_mask, q.dtype,
                  QUANTIZED, CONVERT)
    # (BLOCK_N, BLOCK_D) each

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        causal = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(causal, s, float("-inf"))  # (BLOCK_M, BLOCK_N)
    # key 0 is visible to every row, so the first step makes row_max finite and no row is NaN
    new_max = tl.maximum(row_max, tl.max(s, axis=1))
    alpha = tl.exp2(row_max - new_max)
    p = tl.exp2(s - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


# the block table's width changes from step to step: one compiled kernel for every width,
# not one per divisibility class (a compile in the middle of serving costs ~0.5 s)
@triton.jit(do_not_specialize=["stride_bt"])
def _extend_kernel(
    q_ptr,  # (T, heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    v_cache_ptr,
    k_scale_ptr,  # (num_blocks, block_size, kv_heads) float16, when QUANTIZED
    v_scale_ptr,
    out_ptr,  # (T, heads, head_dim)
    query_start_loc_ptr,  # (B + 1,) int32
    seq_lens_ptr,  # (B,) int32
    block_tables_ptr,  # (B, max_blocks) int32
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_block,
    stride_scale_slot,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr,  # tile rows: BLOCK_Q tokens x GROUP heads, plus unused padding rows
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    PAGE_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # context tokens per loop step
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,  # int8 or e4m3 elements, scales beside them
    DOT_DTYPE: tl.constexpr,  # q's dtype; float16 for a 16-bit model over a quantized cache
    CONVERT: tl.constexpr,  # how the kernel turns int8 / e4m3 into float16 (triton_quant.py)
):
    seq = tl.program_id(0)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest walks launch first
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    q_tok = q_block * BLOCK_Q + offs_m // GROUP  # (BLOCK_M,) index among the new tokens
    heads = kv_head * GROUP + offs_m % GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    q_pos = num_cached + q_tok  # (BLOCK_M,)

    q_offs = (q_start + q_tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_offs, mask=qd_mask, other=0.0).to(DOT_DTYPE)  # (BLOCK_M, BLOCK_D)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    row_sum = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - row_max)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    # keys before the tile's first token are seen by all its rows: no mask up to there
    unmasked_end = (num_cached + q_block * BLOCK_Q) // BLOCK_N * BLOCK_N
    end = num_cached + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # one past the last position
    for n_start in range(0, unmasked_end, BLOCK_N):
        acc, row_sum, row_max = _attend_keys(
            q, acc, row_sum, row_max, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_table, n_start, offs_n, offs_d, d_mask, q_pos, end, kv_head, scale_log2,
            stride_cache_block, stride_cache_slot, stride_cache_head, stride_scale_block,
            stride_scale_slot, PAGE_SIZE, DOT_PRECISION, False, QUANTIZED, CONVERT,
        )  # fmt: skip
    for n_start in range(unmasked_end, end, BLOCK_N):
        acc, row_sum, row_max = _attend_keys(
            q, acc, row_sum, row_max, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_table, n_start, offs_n, offs_d, d_mask, q_pos, end, kv_head, scale_log2,
            stride_cache_block, stride_cache_slot, stride_cache_head, stride_scale_block,
            stride_scale_slot, PAGE_SIZE, DOT_PRECISION, True, QUANTIZED, CONVERT,
        )  # fmt: skip

    out = acc / row_sum[:, None]
    o_offs = (q_start + q_tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)


def extend_attention(
    q: torch.Tensor,  # (T, heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # (B + 1,) int32
    seq_lens: torch.Tensor,  # (B,) int32
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # (T, heads, head_dim)
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, kv_heads): int8/e4m3 only
    v_scale: torch.Tensor | None = None,
    convert: str | None = None,  # exact_values' CONVERT; default: conversion()'s choice
) -> torch.Tensor:
    """Causal paged attention of each sequence's new tokens over its whole context.

    The default tile is the best of ``python -m tools.kernels.tune_extend`` on an H200 at
    W2's prefill steps and W4's prefix hits (2 stages: 437 against 551 µs a layer at W4's)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    scales = check_scales(k_cache, k_scale, v_scale)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    batch_size = seq_lens.shape[0]
    if num_tokens == 0 or batch_size == 0:
        return out
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (batch_size, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        *scales,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * 1.4426950408889634,  # log2(e)
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scales[0].stride(0),
        scales[0].stride(1),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        QUANTIZED=k_scale is not None,
        DOT_DTYPE=dot_dtype(q.dtype, k_cache.dtype),
        CONVERT=convert or conversion(q.device, k_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
