"""Paged attention in plain PyTorch: runs on CPU and GPU, the reference for the Triton kernels.

KV cache layout, per layer: ``k_cache`` and ``v_cache`` of shape
(num_blocks, block_size, num_kv_heads, head_dim); a quantized cache (int8, e4m3) has float16
scales of shape (num_blocks, block_size, num_kv_heads) beside them, written as each token is
stored and multiplied back in as the context is read (workers/attention/kv_quant.py).

Each sequence is one SDPA call in the form of HuggingFace's sdpa attention, so that on the CPU
in float32 greedy output stays token-identical to ``generate()`` (the calls below give HF's
bits exactly): 4-D tensors, grouped KV heads handed to SDPA (``enable_gqa``) rather than
repeated, and no mask where HF passes none. A decode token sees its whole context (no mask); a
whole prompt is ``is_causal``. Only a chunk after cached tokens needs an explicit mask.

Why not one padded call for a step's decode rows: on the CPU a masked SDPA is several times
slower than an unmasked one, so the padded call lost to the per-sequence calls (and changed the
rounding: the kernel blocks a padded row's keys differently).
"""

import torch
import torch.nn.functional as F

from workers.attention.kv_quant import dequantize, quantize
from workers.attention.layer_cache import LayerKVCache
from workers.attention.metadata import AttentionMetadata


def store_kv(
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,)
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, kv_heads), quantized only
    v_scale: torch.Tensor | None = None,
) -> None:
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
        if scale is None:
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x.to(cache.dtype))
            continue
        elements, scales = quantize(x, cache.dtype)  # (T, kv_heads, head_dim), (T, kv_heads)
        as_bytes(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                                     as_bytes(elements))
        scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 as its bytes: the CPU's index_copy_ and index_select take no float8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first seq_len cached rows of one sequence: (seq_len, kv_heads, ...)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    # index_select copies whole blocks: several times faster than cache[ids] on the CPU
    blocks = torch.index_select(cache, 0, block_table[:num_blocks])  # (n, bs, kv_heads, ...)
    return blocks.flatten(0, 1)[:seq_len]


def read_context(
    cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor, seq_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One sequence's K or V, (seq_len, kv_heads, head_dim) of ``dtype``: dequantized when the
    cache has scales."""
    rows = gather_context(as_bytes(cache), block_table, seq_len).view(cache.dtype)
    if scale is None:
        return rows.to(dtype)
    return dequantize(rows, gather_context(scale, block_table, seq_len), dtype)


def attend_one(
    q: torch.Tensor,  # (q_len, heads, head_dim): the sequence's new tokens
    cache: LayerKVCache,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    rows_alone: bool = False,
) -> torch.Tensor:
    """One sequence's new tokens over its seq_len tokens of context: (q_len, heads, hd).
    ``rows_alone``: each token as a decode row over the keys up to it (``attend_rows_alone``)."""
    q_len = q.shape[0]
    qi = q.transpose(0, 1)[None]  # (1, heads, q_len, hd)
    k = read_context(cache.k, cache.k_scale, block_table, seq_len, q.dtype)
    v = read_context(cache.v, cache.v_scale, block_table, seq_len, q.dtype)
    ki, vi = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, kv_heads, L, hd)
    if rows_alone and q_len > 1:
        return attend_rows_alone(qi, ki, vi, scale)
    mask = None
    if 1 < q_len < seq_len:  # query j sits at position seq_len - q_len + j, sees keys <= it
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        qi, ki, vi, attn_mask=mask, scale=scale,
        is_causal=1 < q_len == seq_len, enable_gqa=qi.shape[1] != ki.shape[1],
    )  # (1, heads, q_len, hd)
    return out[0].transpose(0, 1)


def attend_rows_alone(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """(1, heads, q_len, hd) over (1, kv_heads, L, hd) -> (q_len, heads, hd), each query the
    call a decode row makes (one query, its keys, no mask), so its bits are a decode's: SDPA's
    causal, masked and one-query paths round differently, and a quantized cache turns that
    into a different stored key (workers/layers/batch_invariant.py)."""
    q_len, seq_len = qi.shape[2], ki.shape[2]
    rows = []
    for j in range(q_len):
        end = seq_len - q_len + j + 1  # query j sees the keys up to its own position
        rows.append(F.scaled_dot_product_attention(
            qi[:, :, j : j + 1], ki[:, :, :end], vi[:, :, :end], scale=scale,
            enable_gqa=qi.shape[1] != ki.shape[1]))
    return torch.cat(rows, dim=2)[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,  # (T, heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, kv_heads), quantized only
    v_scale: torch.Tensor | None = None,
    rows_alone: bool = False,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context."""
    cache = LayerKVCache(k_cache, v_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    start = 0
    lengths = zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
    for i, (q_len, seq_len) in enumerate(lengths):
        out[start : start + q_len] = attend_one(
            q[start : start + q_len], cache, meta.block_tables[i], seq_len, scale, rows_alone
        )
        start += q_len
    return out


class ReferenceAttentionBackend:
    """Writes the new K/V into the paged cache, then attends with plain PyTorch. With
    ``rows_alone`` every token attends as a decode row would (``attend_rows_alone``)."""

    name = "reference"
    rows_alone = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        return self.attend(q, cache, meta, scale)

    def attend(self, q, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K and V."""
        return paged_attention(q, cache.k, cache.v, meta, scale, cache.k_scale, cache.v_scale,
                               self.rows_alone)
