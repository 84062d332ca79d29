"""The quantized KV cache inside Triton kernels: workers/attention/kv_quant.py's operations
one for one (a float16 scale per row, divided by as stored, halves rounded up for int8), so
the store kernels write the reference's bits and the attention kernels read its values.

Divisions are ``div_rn`` (IEEE rounding): on a GPU a plain ``/`` in float32 is approximate
(``div.full``) and would move a few elements to the neighbouring grid point.
"""

import torch
import triton
import triton.language as tl

from workers.attention.kv_quant import MAX_SCALE, MIN_SCALE, max_abs_of

SCALE_LOW = tl.constexpr(MIN_SCALE)
SCALE_HIGH = tl.constexpr(MAX_SCALE)


@triton.jit
def row_scales(absmax, MAX_ABS: tl.constexpr):
    """(R,) float32 absmax of each row -> (R,) float16 scales, clamped to float16's normals."""
    scale = tl.math.div_rn(absmax, MAX_ABS)
    return tl.minimum(tl.maximum(scale, SCALE_LOW), SCALE_HIGH).to(tl.float16)


@triton.jit
def on_grid(x, scale, MAX_ABS: tl.constexpr, IS_INT: tl.constexpr):
    """x (R, C) float32 over its rows' scales (R,): the values to store, in float32 (exact in
    the cache's dtype for int8; rounded to e4m3 by the store's conversion for fp8)."""
    y = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    y = tl.minimum(tl.maximum(y, -MAX_ABS), MAX_ABS)
    if IS_INT:
        y = tl.floor(y + 0.5)
    return y


@triton.jit
def quantize_rows(x, MAX_ABS: tl.constexpr, IS_INT: tl.constexpr):
    """x (R, C) float32, zeros in any padding columns -> (values to store, (R,) scales)."""
    scale = row_scales(tl.max(tl.abs(x), axis=1), MAX_ABS)
    return on_grid(x, scale, MAX_ABS, IS_INT), scale


@triton.jit
def dequantized(raw, scale, dtype: tl.constexpr):
    """Stored elements (R, C) and their rows' scales (R,) -> values (R, C) of ``dtype``."""
    return (raw.to(tl.float32) * scale.to(tl.float32)[:, None]).to(dtype)


def quant_constants(cache: torch.Tensor) -> dict:
    """The kernels' QUANTIZED, MAX_ABS and IS_INT for a cache tensor of K or V elements."""
    if cache.dtype not in (torch.int8, torch.float8_e4m3fn):
        return {"QUANTIZED": False, "MAX_ABS": 1.0, "IS_INT": False}
    return {"QUANTIZED": True, "MAX_ABS": max_abs_of(cache.dtype),
            "IS_INT": cache.dtype == torch.int8}


@triton.jit
def load_rows(cache_ptr, scale_ptr, offs, mask, scale_offs, row_mask, dtype: tl.constexpr,
              QUANTIZED: tl.constexpr):
    """Cache rows at offs (R, C) as values of ``dtype``: dequantized with their scales (at
    scale_offs (R,)) when QUANTIZED. Masked rows read as zeros."""
    raw = tl.load(cache_ptr + offs, mask=mask, other=0.0)
    if QUANTIZED:
        rows = dequantized(raw, tl.load(scale_ptr + scale_offs, mask=row_mask, other=0.0), dtype)
    else:
        rows = raw.to(dtype)
    return rows


def check_scales(cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors to pass a kernel: a quantized cache's own (contiguous, one a slot and
    kv head), or the cache itself as a pointer never read."""
    quantized = quant_constants(cache)["QUANTIZED"]
    if quantized != (k_scale is not None) or quantized != (v_scale is not None):
        raise ValueError(f"a {cache.dtype} cache needs scales exactly when it is quantized")
    if k_scale is None or v_scale is None:
        return cache, cache
    if k_scale.shape != cache.shape[:3] or not (k_scale.is_contiguous()
                                                and v_scale.is_contiguous()):
        raise ValueError(f"scales must be contiguous, of shape {tuple(cache.shape[:3])}")
    return k_scale, v_scale
