"""Triton kernel that writes the new tokens' K and V rows into the paged KV cache.

One program copies one (token, kv head) row of K and of V: head_dim elements each. A slot below
zero marks a padding token (CUDA graphs pad the batch with slot -1); its program does nothing,
so the cache is never touched for it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,  # (T, kv_heads, head_dim), any strides
    v_ptr,
    k_cache_ptr,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    v_cache_ptr,
    slot_mapping_ptr,  # (T,) int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,  # elements from one slot to the next: kv_heads * head_dim
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + kv_head * stride_kh + offs_d, mask=d_mask)
    v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + offs_d, mask=d_mask)
    # int64 because a large cache holds more than 2**31 elements
    row = slot * stride_cache_slot + kv_head * stride_cache_head + offs_d
    tl.store(k_cache_ptr + row, k.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
    tl.store(v_cache_ptr + row, v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)


def store_kv(
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64, -1 for padding tokens
) -> None:
    """Write each token's K/V row to its cache slot; tokens with a negative slot are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be the innermost dimension"
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
