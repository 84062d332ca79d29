"""The Triton attention kernels on the CPU (TRITON_INTERPRET=1) against the PyTorch reference.

Shapes are small because the interpreter runs every program in numpy. Block tables are
shuffled, so a kernel that assumes contiguous blocks fails.
"""

# the interpreter fixture; TRITON_INTERPRET itself is set by conftest.py
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401, I001

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from workers.attention.layer_cache import LayerKVCache  # noqa: E402
from workers.attention.metadata import AttentionMetadata, longest_first  # noqa: E402
from workers.attention.reference import ReferenceAttentionBackend, paged_attention  # noqa: E402
from workers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from workers.attention.triton_prefill import extend_attention  # noqa: E402
from workers.attention.triton_decode import (  # noqa: E402
    choose_num_splits,
    decode_attention,
    default_tile,
)
from workers.attention.triton_store import store_kv  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def make_batch(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """Random q/k/v for the new tokens, caches holding a random cached prefix, and metadata
    whose block tables are a shuffled (non-contiguous) assignment of the cache blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that no sequence owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq + [1])
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    slots = []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        owned = [order.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(owned[pos // block_size] * block_size + pos % block_size)

    num_tokens = sum(q_lens)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return (
        torch.randn((num_tokens, heads, head_dim), generator=gen).to(dtype),
        torch.randn((num_tokens, kv_heads, head_dim), generator=gen).to(dtype),
        torch.randn((num_tokens, kv_heads, head_dim), generator=gen).to(dtype),
        torch.randn(cache_shape, generator=gen).to(dtype),
        torch.randn(cache_shape, generator=gen).to(dtype),
        meta,
    )


def check_against_reference(batch, dtype):
    q, k, v, k_cache, v_cache, meta = batch
    scale = q.shape[-1] ** -0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = ReferenceAttentionBackend().forward(q, k, v, LayerKVCache(k_ref, v_ref), meta,
                                                   scale)
    got = TritonAttentionBackend().forward(q, k, v, LayerKVCache(k_cache, v_cache), meta, scale)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_store_kv_skips_padding_slots():
    k_cache = torch.zeros((4, 8, 2, 64))
    v_cache = torch.zeros((4, 8, 2, 64))
    qkv = torch.randn((3, 3, 2, 64))  # k and v as strided views of a fused projection
    k, v = qkv[:, 1], qkv[:, 2]
    slot_mapping = torch.tensor([17, -1, 3], dtype=torch.int64)

    store_kv(k, v, k_cache, v_cache, slot_mapping)

    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    assert torch.equal(flat_k[17], k[0]) and torch.equal(flat_k[3], k[2])
    assert torch.equal(flat_v[17], v[0]) and torch.equal(flat_v[3], v[2])
    written = torch.zeros(32, dtype=torch.bool)
    written[[17, 3]] = True
    assert not flat_k[~written].any() and not flat_v[~written].any()


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_decode_matches_reference(heads, kv_heads, block_size):
    seq_lens = [1, 17, 300, 64]
    # the 300-token sequence is longer than a split, so the backend splits its context
    assert choose_num_splits(len(seq_lens), kv_heads, max(seq_lens), num_sms=132) > 1
    batch = make_batch(seq_lens, [1] * 4, heads, kv_heads, 64, block_size, torch.float32)
    check_against_reference(batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype):
    batch = make_batch([300, 5, 40], [1] * 3, 8, 2, 128, 16, dtype, seed=1)
    check_against_reference(batch, dtype)


def test_decode_odd_group_and_head_dim():
    # group of 3 query heads, head_dim 80: both padded inside the kernel
    batch = make_batch([33, 270], [1, 1], 6, 2, 80, 16, torch.float32, seed=2)
    check_against_reference(batch, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_any_split_count_and_padding_row(num_splits):
    """Any split count gives the same answer (CUDA graphs fix it at capture); a padding row
    with seq_len 0 yields zeros; more splits than context leaves some splits empty."""
    q, _, _, k_cache, v_cache, meta = make_batch([130, 9], [1, 1], 8, 2, 64, 8, torch.float32)
    scale = 0.125
    expected = paged_attention(q, k_cache, v_cache, meta, scale)

    padded_q = torch.cat([q, torch.randn((1, 8, 64))])  # (3, heads, head_dim)
    padded_tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])
    padded_lens = torch.tensor([130, 9, 0], dtype=torch.int32)
    got = decode_attention(
        padded_q, k_cache, v_cache, padded_tables, padded_lens, scale, num_splits
    )

    torch.testing.assert_close(got[:2], expected, atol=1e-4, rtol=1e-4)
    assert not got[2].any()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_in_any_row_order(num_splits):
    """The row order only schedules the programs: longest first, or any other permutation,
    writes each row's own output (the padding row's zeros included)."""
    q, _, _, k_cache, v_cache, meta = make_batch([40, 130, 9, 77], [1] * 4, 4, 2, 32, 8,
                                                 torch.float32, seed=3)
    lens = torch.tensor([40, 130, 9, 0], dtype=torch.int32)  # the last row pads
    expected = decode_attention(q, k_cache, v_cache, meta.block_tables, lens, 0.125, num_splits)
    assert longest_first(lens.numpy()).tolist() == [1, 0, 2, 3]
    for order in (longest_first(lens.numpy()), np.array([3, 1, 0, 2], dtype=np.int32)):
        got = decode_attention(q, k_cache, v_cache, meta.block_tables, lens, 0.125, num_splits,
                               order=torch.from_numpy(order))
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert not expected[3].any()


def test_longest_first_keeps_row_order_among_equal_lengths():
    assert longest_first(np.array([3, 9, 0, 9, 5])).tolist() == [1, 3, 4, 0, 2]


@pytest.mark.parametrize("tile", [(32, 2, 3), (64, 4, 3), (128, 4, 2)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_any_tile(tile, num_splits):
    """Every tile the tuning sweep (tools/kernels/tune_decode.py) may pick gives the reference's
    answer; a 150-token context is not a whole number of 128-token steps."""
    q, _, _, k_cache, v_cache, meta = make_batch([150, 9], [1, 1], 8, 2, 64, 16, torch.float32)
    expected = paged_attention(q, k_cache, v_cache, meta, 0.125)
    got = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125,
                           num_splits, tile=tile)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_default_tile_reads_8192_values_a_step_for_one_split_only():
    assert default_tile(1, 128) == default_tile(1, 80) == (64, 4, 3)  # 80 pads to 128
    assert default_tile(1, 64) == default_tile(1, 32) == (128, 4, 3)
    assert default_tile(1, 256) == (32, 4, 3)
    assert default_tile(2, 64) == default_tile(8, 128) == (64, 4, 3)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 2)])
def test_extend_prefix_hits_prefill_and_decode_rows(heads, kv_heads):
    # sequences: a prefix hit, a decode row, a pure prefill spanning 3 query blocks, a chunk
    seq_lens, q_lens = [20, 40, 50, 70], [5, 1, 50, 16]
    batch = make_batch(seq_lens, q_lens, heads, kv_heads, 64, 16, torch.float32, seed=3)
    check_against_reference(batch, torch.float32)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_extend_walks_unmasked_keys_then_the_diagonal(block_m, block_n):
    """Small tiles over long contexts: each program's walk has several unmasked steps (keys
    before its first token) and a masked diagonal; the grid's last query blocks run first."""
    seq_lens, q_lens = [100, 70, 45], [40, 70, 1]  # a prefix hit, a prompt, a decode row
    q, k, v, k_cache, v_cache, meta = make_batch(seq_lens, q_lens, 4, 2, 32, 8, torch.float32,
                                                 seed=6)
    scale = q.shape[-1] ** -0.5
    expected = ReferenceAttentionBackend().forward(
        q, k, v, LayerKVCache(k_cache.clone(), v_cache.clone()), meta, scale)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    got = extend_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                           meta.block_tables, meta.max_query_len, scale, block_m=block_m,
                           block_n=block_n)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_pure_prefill_block_size_8():
    batch = make_batch([7, 24], [7, 24], 8, 2, 64, 8, torch.float32, seed=4)
    check_against_reference(batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_decode_and_prefill_half_precision(dtype):
    batch = make_batch([90, 12, 33], [1, 12, 1], 8, 2, 128, 16, dtype, seed=5)
    check_against_reference(batch, dtype)


def test_short_contexts_use_one_split():
    assert choose_num_splits(1, 8, 256, num_sms=132) == 1
    assert choose_num_splits(1, 8, 4096, num_sms=132) > 1
    assert choose_num_splits(256, 8, 4096, num_sms=132) == 1  # the batch already fills the GPU
