"""The fused matrix-vector kernel (workers/layers/gemv.py) on the CPU (TRITON_INTERPRET=1)
against the unfused PyTorch layers, and the switch that sends one-row inputs to it."""

# the interpreter fixture; TRITON_INTERPRET itself is set by conftest.py
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401, I001

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.workers.test_fused_kernels import assert_close, plain_norm, randn  # noqa: E402
from workers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from workers.layers.gemv import default_config, gemv, qkv_rotary_store  # noqa: E402
from workers.layers.linear import ShardedLinear  # noqa: E402
from workers.layers.parallel import TensorParallelGroup  # noqa: E402
from workers.layers.rotary import apply_rotary  # noqa: E402
from workers.loader import load_model  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# small tiles so that the shapes below take several programs and several K chunks, the last
# of each masked
SMALL = (8, 32, 4, 2)


def weights(rows, k, dtype, seed):
    """Scaled so outputs stay near 1, where bfloat16's step is within the tolerance."""
    return (randn(rows, k, seed=seed) * k**-0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_with_and_without_bias(dtype):
    x, weight, bias = randn(1, 100, dtype=dtype), weights(37, 100, dtype, seed=1), None
    out, residual = gemv(x, weight, config=SMALL)
    assert residual is None
    assert_close(out, F.linear(x, weight), dtype)
    bias = randn(37, dtype=dtype, seed=2)
    assert_close(gemv(x, weight, bias, config=SMALL)[0], F.linear(x, weight, bias), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_before_the_projection(dtype):
    """The first layer's input norm: no residual yet."""
    x, weight = randn(1, 100, dtype=dtype), weights(24, 100, dtype, seed=1)
    norm_weight = 1 + 0.2 * randn(100, dtype=dtype, seed=2)
    out, residual = gemv(x, weight, norm_weight=norm_weight, eps=1e-6, config=SMALL)
    assert residual is None
    assert_close(out, F.linear(plain_norm(norm_weight, 1e-6)(x), weight), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_residual_add_norm_and_silu_mul(dtype, silu_mul):
    """As a decoder layer runs unfused: h = x + residual, then gate_up(RMSNorm(h)), then
    SiLU(gate) * up; h comes back as the new residual."""
    x, residual = randn(1, 80, dtype=dtype), randn(1, 80, dtype=dtype, seed=1)
    weight, bias = weights(2 * 20, 80, dtype, seed=2), randn(2 * 20, dtype=dtype, seed=3)
    norm_weight = 1 + 0.2 * randn(80, dtype=dtype, seed=4)
    out, new_residual = gemv(x, weight, bias, residual=residual, norm_weight=norm_weight,
                             eps=1e-5, silu_mul=silu_mul, config=SMALL)
    h = x + residual
    projected = F.linear(plain_norm(norm_weight, 1e-5)(h), weight, bias)
    if silu_mul:
        gate, up = projected.chunk(2, dim=-1)
        projected = F.silu(gate) * up
    assert out.shape == (1, 20 if silu_mul else 40)
    assert_close(out, projected, dtype)
    assert_close(new_residual, h, dtype)
    if dtype == torch.float32:
        assert torch.equal(new_residual, h)


def rotary_tables(position: int, head_dim: int, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([position * inv_freq, position * inv_freq])[None]  # (1, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def unfused_qkv(x, residual, weight, bias, norm_weight, cos, sin, heads, kv_heads, head_dim):
    """(q, k, v, new residual) as the unfused layer makes them."""
    h = x if residual is None else x + residual
    qkv = F.linear(plain_norm(norm_weight, 1e-5)(h), weight, bias)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.view(1, heads, head_dim), cos, sin)
    k = apply_rotary(k.view(1, kv_heads, head_dim), cos, sin)
    return q, k[0], v.view(kv_heads, head_dim), h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("first_layer,with_bias", [(True, False), (False, True)])
def test_qkv_rotary_store(dtype, first_layer, with_bias):
    """One kernel for a layer's attention input: norm, qkv, rotary on q and k, K and V into
    the cache at the token's slot (slot 9: block 2, offset 1), no other slot touched."""
    heads, kv_heads, head_dim, hidden = 4, 2, 16, 48
    x, residual = randn(1, hidden, dtype=dtype), randn(1, hidden, dtype=dtype, seed=1)
    residual = None if first_layer else residual
    weight = weights((heads + 2 * kv_heads) * head_dim, hidden, dtype, seed=2)
    bias = randn(len(weight), dtype=dtype, seed=3) if with_bias else None
    norm_weight = 1 + 0.2 * randn(hidden, dtype=dtype, seed=4)
    cos, sin = rotary_tables(7, head_dim, dtype)
    k_cache = torch.zeros(4, 4, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q, new_residual = qkv_rotary_store(x, weight, bias, residual, norm_weight, 1e-5, cos, sin,
                                       k_cache, v_cache, torch.tensor([9]), heads,
                                       config=(4, 16, 4, 2))
    want_q, want_k, want_v, h = unfused_qkv(x, residual, weight, bias, norm_weight, cos, sin,
                                             heads, kv_heads, head_dim)
    assert_close(q, want_q, dtype)
    assert_close(k_cache[2, 1], want_k, dtype)
    assert_close(v_cache[2, 1], want_v, dtype)
    k_cache[2, 1], v_cache[2, 1] = 0, 0
    assert not k_cache.any() and not v_cache.any()
    if first_layer:
        assert new_residual is x
    else:
        assert_close(new_residual, h, dtype)


def test_qkv_rotary_store_skips_a_padding_slot():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    cos, sin = rotary_tables(3, 8, torch.float32)
    q, _ = qkv_rotary_store(randn(1, 16), weights(3 * 8, 16, torch.float32, seed=1), None, None,
                            torch.ones(16), 1e-5, cos, sin, k_cache, v_cache, torch.tensor([-1]),
                            1, config=(4, 16, 4, 2))
    assert q.shape == (1, 1, 8) and q.any()
    assert not k_cache.any() and not v_cache.any()


def test_bad_input_is_refused():
    weight = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"gemv takes one row, got input of shape \(2, 16\)"):
        gemv(torch.zeros(2, 16), weight)
    with pytest.raises(ValueError, match=r"weight \(8, 16\) does not take inputs of size 12"):
        gemv(torch.zeros(1, 12), weight)
    with pytest.raises(ValueError, match="a residual is only added before a norm"):
        gemv(torch.zeros(1, 16), weight, residual=torch.zeros(1, 16))
    with pytest.raises(ValueError, match="silu_mul needs gate and up rows, got 7 rows"):
        gemv(torch.zeros(1, 16), torch.zeros(7, 16), silu_mul=True)
    cache, table = torch.zeros(2, 4, 1, 8), torch.zeros(1, 8)
    args = (torch.ones(16), 1e-5, table, table, cache, cache, torch.tensor([0]), 1)
    with pytest.raises(ValueError, match=r"qkv weight \(20, 16\) is not \(24, 16\)"):
        qkv_rotary_store(torch.zeros(1, 16), torch.zeros(20, 16), None, None, *args)
    with pytest.raises(ValueError, match=r"takes one row, got input of shape \(2, 16\)"):
        qkv_rotary_store(torch.zeros(2, 16), torch.zeros(24, 16), None, None, *args)


def test_default_configs_follow_the_h200_sweep():
    # (outputs, K, silu_mul): Llama-3.2-1B qkv, o, gate_up, down; Qwen3-0.6B gate_up;
    # Llama-3.1-8B TP 2 qkv, gate_up
    assert default_config(3072, 2048, False) == (8, 512, 4, 3)
    assert default_config(2048, 2048, False) == (8, 1024, 4, 3)
    assert default_config(8192, 2048, True) == (16, 256, 4, 3)
    assert default_config(2048, 8192, False) == (8, 1024, 4, 3)
    assert default_config(3072, 1024, True) == (8, 256, 4, 3)
    assert default_config(3072, 4096, False) == (8, 1024, 4, 3)
    assert default_config(7168, 4096, True) == (16, 256, 4, 3)
    assert default_config(8, 100, False)[1] == 128  # K chunks no longer than the row
    assert default_config(8, 100, True)[1] == 128
    # float32 weights: half as many per chunk, the same bytes
    assert default_config(2048, 8192, False, itemsize=4) == (8, 512, 4, 3)
    assert default_config(8192, 2048, True, itemsize=4) == (16, 128, 4, 3)


def test_only_fused_models_send_one_row_to_gemv(tiny_models):
    def linears(fused):
        tp, backend = TensorParallelGroup.single(), TritonAttentionBackend()
        model, _ = load_model(tiny_models["llama"], torch.float32, "cpu", tp, backend, fused=fused)
        return [m for m in model.modules() if isinstance(m, ShardedLinear)]

    fused, plain = linears(True), linears(False)
    assert len(fused) == len(plain) > 0
    assert all(m.gemv_for_one_row for m in fused)
    assert not any(m.gemv_for_one_row for m in plain)
