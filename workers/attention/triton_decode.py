"""Triton paged decode attention: one query token per sequence, split-K over long contexts.

Flash-decoding in two kernels. The first runs one program per (sequence, kv head, split)::

    context of a sequence:  [ split 0 | split 1 | ... | split S-1 ]   (the last ones may be empty)
    each program:  the GROUP query heads of its kv head  x  the tokens of its split

It loads each K/V row once for the whole GQA group: the group's query heads are the M
dimension of ``tl.dot`` (padded to 16, the smallest tile the tensor cores take). It keeps an
online softmax over its split and writes a partial result: the normalized output and its
log-sum-exp. The second kernel weighs the partials of every split by their log-sum-exp into
the output. With one split the first kernel writes the output itself and the second is skipped.

Grid and buffer shapes depend only on the batch size, the head counts and the number of
splits, never on the values of ``seq_lens``, so a CUDA graph can capture both launches.
A sequence of length 0 (a padding row) gets an output of zeros.

A quantized cache (int8 or e4m3, ``k_scale``/``v_scale`` given) is read as it is stored, one
byte an element, with each row's float16 scale beside it, and dequantized in registers before
the dots: half the bytes of a bfloat16 cache cross the memory bus (workers/attention/kv_quant.py).
For a 16-bit model the dots then run in float16 (int8 and e4m3 values are float16 numbers),
the elements converted without the SM's slow conversion unit (workers/attention/triton_quant.py).
On an H200 at the Llama-3.1-8B shape such a kernel takes about as long as bfloat16's over the
same tokens (1.02-1.08x), so ~2.1 against ~4.2 TB/s: per token it issues as many instructions
as bfloat16's, and shared memory (the int8 tiles plus their float16 copies for the dots) holds
one program an SM instead of two.

Programs start in grid order, so the grid decides which reads run side by side. The kv heads
of one sequence come first (axis 0): they read neighbouring rows of the same cache blocks at
the same time. With ``order`` (the batch's rows, longest context first) the long sequences
start first and the short ones fill in behind them, instead of a long one starting last and
running alone. At W2's mix (batch 128, contexts 200-2,000) both together take the kernel from
3.47 to 3.79-3.86 TB/s on an H200; either alone gains about 1%.
"""

import torch
import triton
import triton.language as tl

from workers.attention.triton_quant import check_scales, conversion, dot_dtype, load_rows

MIN_TOKENS_PER_SPLIT = 256  # below this the reduction costs more than the parallelism gains
MAX_SPLITS = 32
PROGRAMS_PER_SM = 2  # aim for this many first-kernel programs per SM before splitting stops


# the block table's width changes from step to step: one compiled kernel for every width,
# not one per divisibility class (a compile in the middle of serving costs ~0.5 s)
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr,  # (B, heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    v_cache_ptr,
    k_scale_ptr,  # (num_blocks, block_size, kv_heads) float16, when QUANTIZED
    v_scale_ptr,
    block_tables_ptr,  # (B, max_blocks) int32
    seq_lens_ptr,  # (B,) int32
    order_ptr,  # (B,) int32: the row each program of axis 1 takes, read when ORDERED
    out_ptr,  # (B, heads, head_dim): written only when NUM_SPLITS == 1
    part_out_ptr,  # (B, heads, NUM_SPLITS, head_dim) fp32
    part_lse_ptr,  # (B, heads, NUM_SPLITS) fp32, log2 units
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
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    PAGE_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # context tokens per loop step
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ORDERED: tl.constexpr,
    QUANTIZED: tl.constexpr,  # int8 or e4m3 elements, scales beside them
    DOT_DTYPE: tl.constexpr,  # q's dtype; float16 for a 16-bit model over a quantized cache
    CONVERT: tl.constexpr,  # how the kernel turns int8 / e4m3 into float16 (triton_quant.py)
):
    kv_head = tl.program_id(0)
    seq = tl.load(order_ptr + tl.program_id(1)) if ORDERED else tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # each split takes a whole number of BLOCK_N steps, so only the last step of a split masks
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    q_offs = seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(DOT_DTYPE)  # (BLOCK_H, BLOCK_D)

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores
    row_sum = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - row_max)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    for n_start in range(start, end, BLOCK_N):
        pos = n_start + offs_n
        n_mask = pos < end
        page = tl.load(block_table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = page * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_slot
        kv_offs = rows[:, None] + kv_head * stride_cache_head + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        scale_offs = page * stride_scale_block + (pos % PAGE_SIZE) * stride_scale_slot + kv_head
        k = load_rows(k_cache_ptr, k_scale_ptr, kv_offs, kv_mask, scale_offs, n_mask, q.dtype,
                      QUANTIZED, CONVERT)
        v = load_rows(v_cache_ptr, v_scale_ptr, kv_offs, kv_mask, scale_offs, n_mask, q.dtype,
                      QUANTIZED, CONVERT)
        # (BLOCK_N, BLOCK_D) each

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))  # (BLOCK_H, BLOCK_N)
        # every step has at least one unmasked token, so new_max is finite
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    empty = row_sum == 0.0  # an empty split, or a whole sequence of length 0
    out = acc / tl.where(empty, 1.0, row_sum)[:, None]
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_offs = seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        part = (seq * tl.num_programs(0) * GROUP + heads) * NUM_SPLITS + split  # (BLOCK_H,)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hd_mask)
        lse = tl.where(empty, float("-inf"), row_max + tl.log2(tl.where(empty, 1.0, row_sum)))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,  # (B, heads, NUM_SPLITS, head_dim) fp32
    part_lse_ptr,  # (B, heads, NUM_SPLITS) fp32, log2 units
    out_ptr,  # (B, heads, head_dim)
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # (BLOCK_S,)

    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # all splits empty (seq_len 0): weights of exp2(-inf) = 0 and an output of zeros
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # (BLOCK_S,)
    total = tl.sum(weight, axis=0)
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    o_offs = seq * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split the context only while the grid is too small to fill the GPU and each split stays
    at least MIN_TOKENS_PER_SPLIT long; short contexts always get one split."""
    by_length = triton.cdiv(max(max_seq_len, 1), MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, batch_size * num_kv_heads)
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def default_tile(num_splits: int, head_dim: int, element_bytes: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). One split means a batch large enough to fill the GPU;
    there a step reads 8,192 values of K (and of V) a program, three steps in flight: with the
    rows longest first, `python -m tools.kernels.tune_decode` measured on an H200 153.5
    against 157.6 us for 128-token steps at W2's mix (batch 128, contexts 200-2000, Qwen3-0.6B
    heads, head_dim 128), and 52.7 us at W3's (batch 64, Llama-3.2-1B heads, head_dim 64; best
    52.5). Split contexts (small batches) keep 64-token steps, which waste less on each
    split's masked last step.

    One-byte elements (int8, e4m3) take 16,384 values a step, the 16 KB of bfloat16's 8,192,
    split or not: `python -m tools.kernels.time_kv_decode` (H200, Llama-3.1-8B heads) measured
    int8 at one split 1,530 against 1,802 us for 64-token steps (batch 360, 4,352 tokens;
    1,670 with 8 warps, 1,517 with 2 stages), 20.3 against 22.4 us at batch 1 (4,096 tokens,
    18 splits) and 148.3 against 150.8 at batch 32 (2 splits)."""
    if element_bytes == 1:
        return (max(32, min(128, 16384 // triton.next_power_of_2(head_dim))), 4, 3)
    if num_splits > 1:
        return (64, 4, 3)
    return (max(32, min(128, 8192 // triton.next_power_of_2(head_dim))), 4, 3)


def decode_attention(
    q: torch.Tensor,  # (B, heads, head_dim): one query token per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    seq_lens: torch.Tensor,  # (B,) int32
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # (B, heads, head_dim)
    tile: tuple[int, int, int] | None = None,  # (BLOCK_N, num_warps, num_stages)
    order: torch.Tensor | None = None,  # (B,) int32: a permutation of the rows
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, kv_heads): int8/e4m3 only
    v_scale: torch.Tensor | None = None,
    convert: str | None = None,  # exact_values' CONVERT; default: conversion()'s choice
) -> torch.Tensor:
    """Paged attention of one query token per sequence over its whole cached context.

    ``num_splits`` is the caller's choice (see ``choose_num_splits``); any value gives the same
    result, so a CUDA graph may fix it at capture time. ``tile`` defaults to ``default_tile``.
    ``order`` only schedules: the rows longest first (``longest_first``) run fastest, and any
    permutation gives the same result (``AttentionMetadata.decode_order``).
    """
    block_n, num_warps, num_stages = tile or default_tile(num_splits, q.shape[2],
                                                          k_cache.element_size())
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    scales = check_scales(k_cache, k_scale, v_scale)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch_size == 0:
        return out
    part_out, part_lse = out, out  # unused with one split: the first kernel writes `out`
    if num_splits > 1:
        part_out = torch.empty(
            (batch_size, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (batch_size, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    block_d = triton.next_power_of_2(head_dim)
    if order is not None:
        assert order.shape == (batch_size,) and order.dtype == torch.int32
    _decode_split_kernel[(num_kv_heads, batch_size, num_splits)](
        q,
        k_cache,
        v_cache,
        *scales,
        block_tables,
        seq_lens,
        seq_lens if order is None else order,
        out,
        part_out,
        part_lse,
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
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ORDERED=order is not None,
        QUANTIZED=k_scale is not None,
        DOT_DTYPE=dot_dtype(q.dtype, k_cache.dtype),
        CONVERT=convert or conversion(q.device, k_cache.dtype, num_splits == 1),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch_size, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out
