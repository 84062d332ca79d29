"""Triton kernel that writes the new tokens' K and V rows into the paged KV cache.

One program copies one (token, kv head) row of K and of V: head_dim elements each. A slot below
zero marks a padding token (CUDA graphs pad the batch with slot -1); its program does nothing,
so the cache is never touched for it. Into a quantized cache (int8, e4m3) the program writes
the row quantized with its own scale, the scale beside it (workers/attention/kv_quant.py): the
row is all in registers already, so the absmax costs no extra read.
"""

import torch
import triton
import triton.language as tl

from workers.attention.triton_quant import quant_constants, quantize_rows


@triton.jit
def _store_row(x, cache_ptr, scale_ptr, row, scale_index, d_mask, MAX_ABS: tl.constexpr,
               IS_INT: tl.constexpr, QUANTIZED: tl.constexpr):
    """x (1, BLOCK_D) float32, zeros past HEAD_DIM, into the cache at row (and its scale)."""
    if QUANTIZED:
        x, scale = quantize_rows(x, MAX_ABS, IS_INT)
        tl.store(scale_ptr + scale_index + tl.arange(0, 1), scale)
    tl.store(cache_ptr + row, x.to(cache_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,  # (T, kv_heads, head_dim), any strides
    v_ptr,
    k_cache_ptr,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    v_cache_ptr,
    k_scale_ptr,  # (num_blocks, block_size, kv_heads) float16, contiguous, when QUANTIZED
    v_scale_ptr,
    slot_mapping_ptr,  # (T,) int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,  # elements from one slot to the next: kv_heads * head_dim
    stride_cache_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    QUANTIZED: tl.constexpr,
    MAX_ABS: tl.constexpr,  # 127 (int8) or 448 (e4m3) when QUANTIZED
    IS_INT: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_d = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D): one row, as quantize_rows takes
    d_mask = offs_d < HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + kv_head * stride_kh + offs_d, mask=d_mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + offs_d, mask=d_mask, other=0.0)
    # int64 because a large cache holds more than 2**31 elements
    row = slot * stride_cache_slot + kv_head * stride_cache_head + offs_d
    scale_index = slot * num_kv_heads + kv_head
    _store_row(k.to(tl.float32), k_cache_ptr, k_scale_ptr, row, scale_index, d_mask, MAX_ABS,
               IS_INT, QUANTIZED)
    _store_row(v.to(tl.float32), v_cache_ptr, v_scale_ptr, row, scale_index, d_mask, MAX_ABS,
               IS_INT, QUANTIZED)


def store_kv(
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64, -1 for padding tokens
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, kv_heads), quantized only
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K/V row to its cache slot; tokens with a negative slot are skipped.
    A cache of int8 or e4m3 elements takes the rows quantized, their scales into k/v_scale."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    quant = quant_constants(k_cache)
    if quant["QUANTIZED"] != (k_scale is not None and v_scale is not None):
        raise ValueError(f"a {k_cache.dtype} cache needs scales exactly when it is quantized")
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be the innermost dimension"
    if k_scale is not None and v_scale is not None:
        assert k_scale.is_contiguous() and v_scale.is_contiguous()
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        k_scale if k_scale is not None else k_cache,
        v_scale if v_scale is not None else v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        **quant,
    )
