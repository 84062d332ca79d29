"""The attention-input kernel (workers/layers/attention_input.py) on the CPU under
TRITON_INTERPRET, against the plain layers: per-head RMSNorm, rotary, and the K/V store."""

# the interpreter fixture; TRITON_INTERPRET itself is set by conftest.py
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401, I001

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.workers.test_fused_kernels import TOLERANCE, cos_sin, plain_norm, randn  # noqa: E402
from workers.attention.reference import store_kv  # noqa: E402
from workers.layers.attention_input import attention_input  # noqa: E402
from workers.layers.rotary import apply_rotary  # noqa: E402

HEADS, KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 4, 5  # 6 and 2: q heads padded to 8


def expected(qkv, head_dim, cos, sin, slots, norms, eps, cache_dtype):
    """q, k_cache, v_cache as the unfused layers leave them."""
    q, k, v = qkv.view(qkv.shape[0], -1, head_dim).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    if norms is not None:
        q, k = plain_norm(norms[0], eps)(q), plain_norm(norms[1], eps)(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim, dtype=cache_dtype)
              for _ in range(2)]
    kept = slots >= 0
    store_kv(k[kept], v[kept], *caches, slots[kept])
    return q, *caches


def run_against_the_unfused_layers(qkv, expected_qkv, head_dim, slots, norms, dtype, **kwargs):
    """attention_input(qkv, **kwargs) against the unfused layers run on expected_qkv: checks q
    and k, returns (v_cache, the v_cache expected)."""
    cos, sin = cos_sin(qkv.shape[0], head_dim, dtype)
    want_q, want_k, want_v = expected(expected_qkv, head_dim, cos, sin, slots, norms, 1e-6, dtype)
    k_cache, v_cache = torch.zeros_like(want_k), torch.zeros_like(want_v)
    q = attention_input(qkv, HEADS, cos, sin, k_cache, v_cache, slots,
                        *(norms or (None, None)), eps=1e-6, **kwargs)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q.float(), want_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.float(), want_k.float(), atol=tol, rtol=tol)
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert not k_cache.view(-1, KV_HEADS, head_dim)[untouched].any()
    assert not v_cache.view(-1, KV_HEADS, head_dim)[untouched].any()
    return v_cache, want_v


def head_norms(qk_norm: bool, head_dim: int, dtype):
    return (1 + 0.2 * randn(head_dim, dtype=dtype, seed=1),
            1 + 0.2 * randn(head_dim, dtype=dtype, seed=2)) if qk_norm else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, qk_norm", [(32, True), (32, False), (24, True)])
def test_matches_the_unfused_layers(dtype, head_dim, qk_norm):
    qkv = randn(5, (HEADS + 2 * KV_HEADS) * head_dim, dtype=dtype)
    slots = torch.tensor([3, 17, -1, 0, 9])  # token 2 pads a CUDA graph's batch
    norms = head_norms(qk_norm, head_dim, dtype)
    v_cache, want_v = run_against_the_unfused_layers(qkv, qkv, head_dim, slots, norms, dtype)
    assert torch.equal(v_cache, want_v)  # v is copied as it is


def inverse_rms(rows: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, 1) float32: 1 / RMS of each row, as RMSNorm takes it."""
    rows = rows.float()
    return torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_row_scale_scales_each_qkv_row_by_its_inputs_inverse_rms(dtype, qk_norm):
    """A qkv projection of the unnormalized rows (norm weights folded into it), then
    row_scale = a qkv projection of the normed rows."""
    head_dim, eps = 32, 1e-5
    qkv = randn(4, (HEADS + 2 * KV_HEADS) * head_dim, dtype=dtype)
    rows = 3 * randn(4, 48, dtype=dtype, seed=3)
    scaled_qkv = (qkv.float() * inverse_rms(rows, eps)).to(dtype)
    slots = torch.tensor([3, -1, 0, 9])
    v_cache, want_v = run_against_the_unfused_layers(
        qkv, scaled_qkv, head_dim, slots, head_norms(qk_norm, head_dim, dtype), dtype,
        row_scale=(rows, eps),
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(v_cache.float(), want_v.float(), atol=tol, rtol=tol)


def test_a_cache_of_another_dtype_takes_the_rounded_values():
    qkv = randn(2, (HEADS + 2 * KV_HEADS) * 32)
    cos, sin = cos_sin(2, 32, torch.float32)
    slots = torch.tensor([1, 2])
    want_q, want_k, want_v = expected(qkv, 32, cos, sin, slots, None, 0.0, torch.bfloat16)
    k_cache, v_cache = torch.zeros_like(want_k), torch.zeros_like(want_v)
    q = attention_input(qkv, HEADS, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    # within bfloat16's rounding: the interpreter truncates to it where torch and a GPU round
    torch.testing.assert_close(k_cache.float(), want_k.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(v_cache.float(), want_v.float(), atol=2e-2, rtol=2e-2)


def test_bad_input_is_refused():
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 32)
    cos, sin = cos_sin(2, 32, torch.float32)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"qkv of shape \(2, 320\) does not hold 7 q heads and "
                                         r"2 k and v heads of 32"):
        attention_input(torch.zeros(2, 320), 7, cos, sin, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="q and k are normed together or not at all"):
        attention_input(torch.zeros(2, 320), HEADS, cos, sin, cache, cache.clone(), slots,
                        q_norm=torch.ones(32))
    with pytest.raises(ValueError, match=r"cos and sin must be \(2, 32\), head_dim even"):
        attention_input(torch.zeros(2, 320), HEADS, cos[:1], sin[:1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match=r"row_scale's rows must be \(2, hidden\) with the last "
                                         r"stride 1, got \(3, 64\)"):
        attention_input(torch.zeros(2, 320), HEADS, cos, sin, cache, cache.clone(), slots,
                        row_scale=(torch.ones(3, 64), 1e-6))
    assert attention_input(torch.zeros(0, 320), HEADS, cos[:0], sin[:0], cache, cache.clone(),
                           slots[:0]).shape == (0, HEADS, 32)
