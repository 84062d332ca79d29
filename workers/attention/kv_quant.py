"""Quantized KV in PyTorch: each token's K (or V) row of one kv head becomes int8 or float8
e4m3 elements and one float16 scale; the reference backend's store and read, and the
definition the Triton kernels follow operation for operation (workers/attention/triton_quant.py).

Why per token and per head: KIVI quantizes keys per channel (their outliers sit in a few
channels) and values per token, but a per-channel scale spans all the tokens of a group, so
it changes while the group fills or must wait for the group to be full. In a paged cache a
block's scales must be written once, with its tokens, and never change: a prefix hit shares
the block as it is, an offload tier copies it, a rolled-back draft's slot is simply written
again. A scale per (token, kv head) is exactly that, it is computed from the row being
stored (no calibration), and the attention kernels load it beside the row they already read.
The outlier channels that KIVI answers with per-channel keys cost accuracy here only through
the head's absmax, which the measured agreement (`tandem bench kv-accuracy`) bounds.

The error of one element x, the scale s as stored (float16), x̂ the dequantized value:

- int8:  |x - x̂| <= s / 2, with s ~= absmax / 127 (the rounding step of the row);
- fp8:   |x - x̂| <= |x| / 16 + s / 1024 (e4m3 keeps 3 mantissa bits; below its smallest
  normal, 2**-6 in units of s, it rounds in steps of 2**-9).

Quantizing divides by the scale as stored, after its rounding to float16, so the bounds hold
exactly; the scale is clamped to float16's normal range, so it is never 0 or infinite (a row
of zeros gets the smallest scale and zeros). The clamp coarsens only int8 rows whose absmax is
below 127 * 2**-14 = 0.0078: SmolLM2-135M's smallest K or V row over the accuracy texts has
0.038.
"""

import torch

from kvstore import kv_format
from kvstore.kv_format import KVFormat

MIN_SCALE = 2.0**-14  # float16's smallest normal number
MAX_SCALE = 65504.0  # float16's largest
SCALE_DTYPE: torch.dtype = getattr(torch, kv_format.SCALE_DTYPE)  # why float16: kvstore


def element_dtype(fmt: KVFormat) -> torch.dtype:
    return getattr(torch, fmt.element_dtype)


def max_abs_of(dtype: torch.dtype) -> float:
    """The largest magnitude a quantized cache of ``dtype`` stores: 127 or 448."""
    for fmt in kv_format.QUANTIZED_FORMATS:
        if element_dtype(fmt) == dtype:
            assert fmt.max_abs is not None
            return fmt.max_abs
    raise ValueError(f"{dtype} is not a quantized KV element dtype")


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (elements (..., head_dim) of ``dtype``, scales (...) float16)."""
    max_abs = max_abs_of(dtype)
    x = x.float()
    absmax = x.abs().amax(dim=-1)
    scale = (absmax / max_abs).clamp(MIN_SCALE, MAX_SCALE).to(SCALE_DTYPE)
    y = (x / scale.float()[..., None]).clamp(-max_abs, max_abs)
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)  # halves round up, as in the kernels: the same bits
    return y.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """elements (..., head_dim) and scales (...) -> values (..., head_dim) of ``dtype``; the
    product is taken in float32 (exact for both formats: at most 18 significant bits)."""
    return (q.float() * scale.float()[..., None]).to(dtype)
