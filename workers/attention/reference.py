"""Paged attention in plain PyTorch: runs on CPU and GPU, the reference for the Triton kernels.

KV cache layout, per layer: ``k_cache`` and ``v_cache`` of shape
(num_blocks, block_size, num_kv_heads, head_dim).
"""

import torch
import torch.nn.functional as F

from workers.attention.metadata import AttentionMetadata


def store_kv(
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,)
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first seq_len cached rows of one sequence: (seq_len, kv_heads, head_dim)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # (n, block_size, kv_heads, head_dim)
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention(
    q: torch.Tensor,  # (T, heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    lengths = zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
    for i, (q_len, seq_len) in enumerate(lengths):
        qi = q[start : start + q_len].transpose(0, 1)  # (heads, q_len, head_dim)
        ki = gather_context(k_cache, meta.block_tables[i], seq_len).transpose(0, 1)
        vi = gather_context(v_cache, meta.block_tables[i], seq_len).transpose(0, 1)
        if num_kv_heads != num_heads:  # GQA: each KV head serves a group of query heads
            ki = ki.repeat_interleave(num_heads // num_kv_heads, dim=0)
            vi = vi.repeat_interleave(num_heads // num_kv_heads, dim=0)
        # query j sits at position seq_len - q_len + j and sees keys at positions <= it
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        oi = F.scaled_dot_product_attention(
            qi, ki.to(qi.dtype), vi.to(qi.dtype), attn_mask=mask, scale=scale
        )  # (heads, q_len, head_dim)
        out[start : start + q_len] = oi.transpose(0, 1)
        start += q_len
    return out


class ReferenceAttentionBackend:
    """Writes the new K/V into the paged cache, then attends with plain PyTorch."""

    name = "reference"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)
