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


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """Whether cache elements of ``dtype`` are quantized ones."""
    return dtype in (torch.int8, torch.float8_e4m3fn)


def quant_constants(cache: torch.Tensor) -> dict:
    """The kernels' QUANTIZED, MAX_ABS and IS_INT for a cache tensor of K or V elements."""
    if not is_quantized_dtype(cache.dtype):
        return {"QUANTIZED": False, "MAX_ABS": 1.0, "IS_INT": False}
    return {"QUANTIZED": True, "MAX_ABS": max_abs_of(cache.dtype),
            "IS_INT": cache.dtype == torch.int8}


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


# ---- reading quantized rows (decode and extend attention) ----------------------------------
#
# Rows are dequantized in the dots' dtype (``dot_dtype``): float16 for a 16-bit model, since
# every int8 and e4m3 value is exactly a float16 number; an element is converted, then
# multiplied by its row's scale, two at a time in float16. How it is converted decides the
# kernels' speed: a Hopper SM converts int8 to float (I2F) at 16 results a clock against 128
# float adds, so a plain cast of a one-byte cache costs more time than reading it.
#
# The conversions below are inline PTX marked impure (is_pure=False) on purpose: Triton then
# keeps them where they are written, on rows read from shared memory in wide loads, and moves
# the float16 rows into the dots' layout through shared memory (ldmatrix). A pure conversion
# it hoists past that move, reading the one-byte elements in the dot layout a byte or two at
# a time: V's rows run along the dot's K dimension, so each thread's elements are 128 bytes
# apart. In SASS at head_dim 128, 128-token steps: 1,608 instructions a decode step with the
# impure conversions, 2,576 with pure ones (236 shared loads against 60). The price is the
# float16 copies in shared memory (see ``conversion`` for where the hoisted cast wins).

@triton.jit
def _int8_as_fp16(raw):
    """int8 -> float16 four at a time without the conversion unit (I2F): each byte, its sign
    bit flipped (x + 128), becomes the low byte of the float16 1024 + (x + 128); subtracting
    1152 leaves x (FasterTransformer's trick, elements in order)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u, bias;
        xor.b32 u, $2, 0x80808080;
        prmt.b32 $0, u, 0x64646464, 0x5150;
        prmt.b32 $1, u, 0x64646464, 0x5352;
        mov.b32 bias, 0x64806480;
        sub.f16x2 $0, $0, bias;
        sub.f16x2 $1, $1, bias;
        }""",
        constraints="=r,=r,r", args=[raw], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _e4m3_as_fp16(raw):
    """e4m3 -> float16 four at a time, two per conversion (Hopper's packed cvt)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r", args=[raw], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def exact_values(raw, dtype: tl.constexpr, CONVERT: tl.constexpr):
    """Stored int8 / e4m3 elements (R, C) as dot operands of ``dtype`` (float32, or float16
    for 16-bit models), unscaled and exact. CONVERT 'asm': the PTX above (compiled kernels,
    float16 only); 'cast': Triton's conversion (the interpreter's path)."""
    if CONVERT == "asm" and dtype == tl.float16:
        if raw.dtype == tl.int8:
            values = _int8_as_fp16(raw)
        else:
            values = _e4m3_as_fp16(raw.to(tl.uint8, bitcast=True))
    else:
        values = raw.to(dtype)
    return values


@triton.jit
def load_scales(scale_ptr, index, mask):
    """(R,) float32: the float16 scales at element ``index`` (R,), read as the 4-byte words
    holding them. Triton's pipeliner copies a load of 4 bytes a thread ahead of the loop
    step (cp.async) but not one of 2, which would stall every step on its latency; the
    word's other half (a neighbouring head's scale) is dropped. Never past the tensor's end:
    it holds block_size * kv_heads * blocks scales, an even count."""
    words = tl.load(scale_ptr.to(tl.pointer_type(tl.int32)) + (index >> 1), mask=mask,
                    other=0)
    half = (words >> ((index & 1) * 16).to(tl.int32)) & 0xFFFF
    return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_rows(cache_ptr, scale_ptr, offs, mask, scale_offs, row_mask, dtype: tl.constexpr,
              QUANTIZED: tl.constexpr, CONVERT: tl.constexpr):
    """Cache rows at offs (R, C) as values of ``dtype``: dequantized with their scales (at
    scale_offs (R,)) when QUANTIZED, the product taken in ``dtype`` (float16 for a 16-bit
    model: ``dot_dtype``; a row whose absmax passed float16's 65,504 would read as inf).
    Masked rows read as zeros."""
    raw = tl.load(cache_ptr + offs, mask=mask, other=0.0)
    if QUANTIZED:
        scale = load_scales(scale_ptr, scale_offs, row_mask).to(dtype)
        rows = exact_values(raw, dtype, CONVERT) * scale[:, None]
    else:
        rows = raw.to(dtype)
    return rows


def dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tl.dtype:
    """The attention dots' operand dtype: q's, except float16 for a 16-bit model over a
    quantized cache (int8 and e4m3 values are float16 numbers; bfloat16 lacks int8's)."""
    if q_dtype == torch.float32:
        return tl.float32
    if is_quantized_dtype(cache_dtype):
        return tl.float16
    return tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16


def conversion(device: torch.device, cache_dtype: torch.dtype, one_split: bool = False) -> str:
    """``exact_values``' CONVERT for a kernel reading a ``cache_dtype`` cache on ``device``:
    a plain cast under the interpreter (it runs no PTX); on a GPU the packed PTX, except e4m3
    in a decode launch of one split, where Triton's own conversion measured faster.
    `python -m tools.kernels.time_kv_decode`, H200, Llama-3.1-8B heads, time against bf16's:
    int8 asm 1.02-1.08x, cast 1.14-1.69x; e4m3 one split cast 0.98-1.01x, asm 1.02-1.06x;
    e4m3 split (batch 32) asm 1.05x, cast 1.56x; extend (two 4,096-token prompts) int8
    1,334 us asm against 1,604 cast, e4m3 1,217 against 1,358 (bf16 957)."""
    if device.type != "cuda":
        return "cast"
    if one_split and cache_dtype == torch.float8_e4m3fn:
        return "cast"
    return "asm"
