"""Attention backend on Triton kernels: the GPU counterpart of ReferenceAttentionBackend."""

import torch

from workers.attention.layer_cache import LayerKVCache
from workers.attention.metadata import AttentionMetadata
from workers.attention.triton_decode import choose_num_splits, decode_attention
from workers.attention.triton_prefill import extend_attention
from workers.attention.triton_store import store_kv

# Under TRITON_INTERPRET on the CPU, pretend to be an H200 so tests take the GPU's split choices.
SMS_WITHOUT_CUDA = 132


class TritonAttentionBackend:
    """Writes the new K/V into the paged cache, then attends with the Triton kernels.

    A pure-decode batch (one new token per sequence) takes the split-K decode kernel; anything
    else, including decodes mixed with prefill chunks, takes the extend kernel. Neither reads
    ``seq_lens`` on the host: launch sizes come from the host ints in ``meta``.
    """

    name = "triton"

    def forward(
        self,
        q: torch.Tensor,  # (T, heads, head_dim)
        k: torch.Tensor,  # (T, kv_heads, head_dim)
        v: torch.Tensor,  # (T, kv_heads, head_dim)
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        return self.attend(q, cache, meta, scale)

    def attend(self, q, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K and V."""
        scales = {"k_scale": cache.k_scale, "v_scale": cache.v_scale}
        if meta.is_pure_decode:
            assert q.shape[0] == meta.num_seqs, "decode expects one query row per sequence"
            num_splits = meta.decode_num_splits or choose_num_splits(
                meta.num_seqs, cache.num_kv_heads, meta.max_seq_len, num_sms(q.device)
            )
            return decode_attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale,
                                    num_splits, order=meta.decode_order, **scales)
        return extend_attention(
            q,
            cache.k,
            cache.v,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            scale,
            **scales,
        )


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return SMS_WITHOUT_CUDA
    # torch caches device properties, so this costs nothing after the first call
    return torch.cuda.get_device_properties(device).multi_processor_count
