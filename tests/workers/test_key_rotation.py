"""Hadamard-rotated keys: the matrix, the rule for head_dim, and a model's cache holding
k @ H (v as it is) while its attention stays that of the unrotated keys."""

import pytest
import torch

from kvstore.kv_format import FP8, INT8, kv_format
from tests.workers.test_models import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    PROMPT_LEN,
    load_ours,
    metadata,
    prompt,
)
from workers.attention.key_rotation import hadamard, key_rotation, rotate
from workers.attention.kv_quant import dequantize, quantize
from workers.attention.layer_cache import LayerKVCache
from workers.kv_cache import allocate_kv_caches


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_is_symmetric_orthonormal_and_of_equal_magnitudes(n):
    h = hadamard(n, torch.float64)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64),
                               atol=1e-15, rtol=0)


def test_rotating_twice_gives_x_back_and_keeps_dot_products():
    h = hadamard(64)
    x, y = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)).split([2, 1])
    torch.testing.assert_close(rotate(rotate(x, h), h), x, atol=2e-6, rtol=0)
    torch.testing.assert_close((rotate(x, h) * rotate(y, h)).sum(-1), (x * y).sum(-1),
                               atol=1e-5, rtol=0)
    assert rotate(x, None) is x


@pytest.mark.parametrize("n", [0, 3, 24, 96])
def test_an_order_that_is_no_power_of_two_is_refused(n):
    with pytest.raises(ValueError, match=f"^a Sylvester Hadamard matrix has a power-of-two "
                                         f"order, not {n}$"):
        hadamard(n)


def test_a_cache_gets_the_matrix_only_where_its_format_rotates_keys():
    auto = kv_format("auto", "float32")
    assert key_rotation(INT8, 80, torch.float32, torch.device("cpu")) is None
    assert key_rotation(auto, 64, torch.float32, torch.device("cpu")) is None
    assert key_rotation(FP8, 64, torch.float32, torch.device("cpu")) is None  # e4m3: unrotated
    assert torch.equal(key_rotation(INT8, 16, torch.float32, torch.device("cpu")), hadamard(16))


def test_rotation_shrinks_the_int8_error_of_a_row_with_an_outlier_channel():
    """One channel 40x the others sets the row's absmax; rotated, its weight spreads over all
    64 channels, the step falls about 5x and so does the error, measured after turning back."""
    row = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
    row[:, 7] = 40.0
    h = hadamard(64)
    plain_error = (dequantize(*quantize(row, torch.int8), torch.float32) - row).norm()
    turned = rotate(dequantize(*quantize(rotate(row, h), torch.int8), torch.float32), h)
    assert (turned - row).norm() < plain_error / 4


def test_a_rotation_that_does_not_fit_head_dim_is_refused():
    zeros = torch.zeros((4, 8, 2, 64), dtype=torch.int8)
    scales = torch.zeros((4, 8, 2), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^a key rotation of shape \(32, 32\) does not fit "
                                         r"head_dim 64$"):
        LayerKVCache(zeros, zeros, scales, scales, hadamard(32))


def prefill(model, config, ids, fmt):
    """The prompt's logits and the caches (in ``fmt``; None: float32) it was stored into."""
    caches = allocate_kv_caches(config, 1, NUM_BLOCKS, BLOCK_SIZE, torch.float32,
                                torch.device("cpu"), fmt)
    with torch.no_grad():
        hidden = model(ids[:PROMPT_LEN], torch.arange(PROMPT_LEN), caches,
                       metadata(0, PROMPT_LEN))
        return model.compute_logits(hidden), caches


def test_the_model_stores_rotated_keys_and_attends_as_without_them(tiny_models):
    model, config = load_ours(tiny_models["llama"])
    ids = prompt(config.vocab_size)
    exact, exact_caches = prefill(model, config, ids, None)
    got, caches = prefill(model, config, ids, INT8)
    h = hadamard(config.hidden_size // config.num_attention_heads)
    layer, want = caches[0], exact_caches[0]  # the first layer's input is the same in both
    assert torch.equal(layer.key_rotation, h) and want.key_rotation is None
    half_step = layer.k_scale.float()[..., None] / 2
    keys = dequantize(layer.k, layer.k_scale, torch.float32)
    assert ((keys - rotate(want.k, h)).abs() <= half_step + 1e-6).all()  # k @ H, quantized
    half_step = layer.v_scale.float()[..., None] / 2
    values = dequantize(layer.v, layer.v_scale, torch.float32)
    assert ((values - want.v).abs() <= half_step + 1e-6).all()  # v as it is
    # queries turned alike: the logits are the float32 cache's but for int8's rounding (1.5%
    # of their norm, as unrotated: random weights have no outlier channels to spread)
    assert 0 < (got - exact).norm() / exact.norm() < 0.03
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
