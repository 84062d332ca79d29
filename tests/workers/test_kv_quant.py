"""Quantize -> dequantize (workers/attention/kv_quant.py) within the stated error bounds, on
random and outlier-heavy rows, rows of zeros and rows too small for float16's normals."""

import pytest
import torch

from workers.attention.kv_quant import MIN_SCALE, dequantize, quantize

HEAD_DIM = 64
# float32 rounds x / s (2**-24 relative) before the grid does: a hair past the exact bound
SLACK = 1e-6


def rows(kind: str) -> torch.Tensor:
    """(tokens, kv_heads, head_dim) float32 rows of one kind."""
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    x = torch.randn((64, 4, HEAD_DIM), generator=gen)
    if kind == "outlier channels":  # KIVI's keys: a few channels 50x the rest
        x[..., [3, 17, 40]] *= 50.0
    elif kind == "one huge element":  # one element a row dominates its scale
        x[:, :, 0] = 1e4
    elif kind == "heavy tails":
        x = torch.distributions.StudentT(2.0).sample((64, 4, HEAD_DIM))
    elif kind == "large":
        x = x * 3e3
    elif kind == "tiny":  # absmax / 127 below float16's smallest normal: the scale clamps
        x = x * 1e-4
    elif kind == "zeros":
        x = torch.zeros_like(x)
    return x


KINDS = ["random", "outlier channels", "one huge element", "heavy tails", "large", "tiny",
         "zeros"]


@pytest.mark.parametrize("kind", KINDS)
def test_int8_error_is_at_most_half_a_step(kind):
    x = rows(kind)
    q, scale = quantize(x, torch.int8)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == x.shape[:2]
    assert q.abs().max() <= 127 and (scale >= MIN_SCALE).all()
    error = (x.double() - dequantize(q, scale, torch.float32).double()).abs()
    assert (error <= scale.double()[..., None] * (0.5 + SLACK)).all()
    absmax = x.abs().amax(dim=-1).double()
    # the step is absmax / 127 up to float16's rounding of it (2**-11), or the clamp's minimum
    assert (scale.double() <= torch.clamp(absmax / 127 * (1 + 2**-11), min=MIN_SCALE)).all()
    assert (error.amax(dim=-1) <= absmax / 254 * (1 + 2**-10) + MIN_SCALE / 2).all()
    if kind not in ("tiny", "zeros"):  # the row's largest element lands on the grid's end
        assert (q.abs().amax(dim=-1) == 127).all()


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_error_is_at_most_a_sixteenth_plus_the_subnormal_step(kind):
    x = rows(kind)
    q, scale = quantize(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float16
    assert q.float().abs().max() <= 448 and not q.float().isnan().any()
    error = (x.double() - dequantize(q, scale, torch.float32).double()).abs()
    bound = x.double().abs() / 16 + scale.double()[..., None] / 1024
    assert (error <= bound * (1 + SLACK)).all()


def test_dequantize_gives_the_compute_dtype():
    x = rows("random").to(torch.bfloat16)
    q, scale = quantize(x, torch.int8)
    out = dequantize(q, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # bfloat16's own rounding (2**-9 relative) on top of the int8 step
    error = (x.float() - out.float()).abs()
    assert (error <= scale.float()[..., None] * 0.5 + x.float().abs() * 2**-8).all()


def test_only_quantized_element_dtypes_are_taken():
    with pytest.raises(ValueError) as error:
        quantize(rows("random"), torch.bfloat16)
    assert str(error.value) == "torch.bfloat16 is not a quantized KV element dtype"
