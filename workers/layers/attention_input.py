"""A batch's attention input in one kernel: from the qkv projection's output to q for the
attention kernel and k, v in the paged cache.

Unfused, a layer takes four launches between its qkv matmul and its attention: RMSNorm of the
q heads and of the k heads (Qwen3's per-head norms), rotary on both, and the K/V store. Each is
a few µs of ramp for a few KB a token, and a decode step at W2's batch runs them 28 times. Here
one program per token reads the token's row of the qkv output once::

    qkv row:  [ q heads | k heads | v heads ]
    q heads   -> (norm) -> rotary -> q_out[token]
    k heads   -> (norm) -> rotary -> k_cache[slot]
    v heads   ------------------- -> v_cache[slot]       (nothing stored for a slot below 0)

It rounds where the plain layers round (the norm's output, rotary's output, the cache's
dtype), so the two agree as far as summation order allows. Into a quantized cache (int8,
e4m3) each k and v head is quantized with its own scale as store_kv would (the absmax of the
head's two rotated halves), the scales beside the cache (workers/attention/kv_quant.py); with
``key_center`` the k heads lose the layer's center first, rounded as ``stored_keys``'
subtraction in the activation dtype. With ``rotate`` (a cache of Hadamard-rotated keys: int8)
the q heads and the (centered) k heads are turned by the head_dim Hadamard matrix in the same
program (workers/attention/key_rotation.py): a fast Walsh-Hadamard transform of each head in
registers, log2(head_dim) butterfly stages over its two halves, in float32, then times the
matrix's entry and rounded as the matmul q @ H rounds. Before, a rotated cache took four
launches more a layer (a scratch store, two small matmuls, the quantizing store).

With ``row_scale`` the qkv projection was given the layer's input unnormalized, its weight
holding the input RMSNorm's weight (LlamaModel.fold_norm_weights): the program first takes
the token's 1 / RMS from that input row and scales the whole qkv row by it, which is where the
input norm's launch went.
"""

import functools

import torch
import triton
import triton.language as tl

from workers.attention.key_rotation import hadamard
from workers.attention.triton_quant import check_scales, on_grid, quant_constants, row_scales
from workers.layers.fused_kernels import inverse_rms_of_row


@triton.jit
def _scaled(x, row_scale, ROW_SCALE: tl.constexpr):
    """x as the unfolded projection would have written it: times the row's 1 / RMS, rounded."""
    if ROW_SCALE:
        x = (x.to(tl.float32) * row_scale).to(x.dtype)
    return x


@triton.jit
def _normed_rotated_heads(
    row_ptr, norm_ptr, cos, sin, eps, num_heads, row_scale, scale_row_ptr, scale_size,
    scale_eps,
    QK_NORM: tl.constexpr, ROW_SCALE: tl.constexpr, FIND_SCALE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """(first halves, second halves, row_scale) of num_heads heads starting at row_ptr, each
    (BLOCK_H, BLOCK_HALF) in the activation dtype: scaled by row_scale when ROW_SCALE,
    RMSNorm'd with norm_ptr's weight when QK_NORM, then turned by rotary (cos, sin:
    (1, BLOCK_HALF) float32). With FIND_SCALE, row_scale is first taken from scale_row_ptr's
    row, after the heads' loads are issued so that the two reads overlap."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = row_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (offs < HALF)
    first = row_ptr + heads * HEAD_DIM + offs
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    if QK_NORM:
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        whole = tl.load(row_ptr + heads * HEAD_DIM + offs_d,
                        mask=(heads < num_heads) & (offs_d < HEAD_DIM), other=0.0)
    if FIND_SCALE:
        row_scale = inverse_rms_of_row(scale_row_ptr, scale_size, scale_eps, BLOCK_S)
    x1, x2 = _scaled(x1, row_scale, ROW_SCALE), _scaled(x2, row_scale, ROW_SCALE)
    if QK_NORM:
        # the sum of squares over the whole head, as RMSNorm takes it
        whole = _scaled(whole, row_scale, ROW_SCALE).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(whole * whole, axis=1) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(norm_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        x1 = (w1 * (x1.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (x2.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype), row_scale


@triton.jit
def _hadamard(x1, x2, entry, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
              LOG2_D: tl.constexpr, ROTATE: tl.constexpr):
    """(x1 | x2) @ H for heads held as halves (BLOCK_H, HALF), H the normalized Sylvester
    Hadamard matrix of order 2 * HALF whose entries are +-``entry``: each stage makes
    y[2i] = x[i] + x[i + HALF], y[2i + 1] = x[i] - x[i + HALF] (constant geometry: after
    log2(2 HALF) stages y = x @ H unnormalized), summed in float32, rounded once at the end."""
    if ROTATE:
        dtype = x1.dtype
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        for _ in tl.static_range(LOG2_D):
            pairs = tl.join(x1 + x2, x1 - x2)  # (BLOCK_H, HALF, 2): y in order, two at a time
            x1, x2 = tl.split(tl.permute(tl.reshape(pairs, (BLOCK_H, 2, HALF)), (0, 2, 1)))
        x1, x2 = (x1 * entry).to(dtype), (x2 * entry).to(dtype)
    return x1, x2


@triton.jit
def _centered(k1, k2, center_ptr, kv_heads, offs, kv_mask, HALF: tl.constexpr,
              CENTERED: tl.constexpr):
    """The k heads' halves less the layer's center (kv_heads, HEAD_DIM) when CENTERED: the
    difference in float32, rounded to the activation dtype (as torch subtracts two tensors of
    that dtype)."""
    if CENTERED:
        dtype = k1.dtype
        c1 = tl.load(center_ptr + kv_heads * (2 * HALF) + offs, mask=kv_mask, other=0.0)
        c2 = tl.load(center_ptr + kv_heads * (2 * HALF) + HALF + offs, mask=kv_mask, other=0.0)
        k1 = (k1.to(tl.float32) - c1.to(tl.float32)).to(dtype)
        k2 = (k2.to(tl.float32) - c2.to(tl.float32)).to(dtype)
    return k1, k2


@triton.jit
def _store_k_heads(k1, k2, k_cache, k_scale_ptr, scale_index, kv_mask, head_mask,
                   HALF: tl.constexpr, QUANTIZED: tl.constexpr, MAX_ABS: tl.constexpr,
                   IS_INT: tl.constexpr):
    """The rotated halves (BLOCK_KV, BLOCK_HALF) of the k heads into the cache at k_cache;
    quantized, one scale a head over both halves (padding lanes are zeros)."""
    if QUANTIZED:
        k1, k2 = k1.to(tl.float32), k2.to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(k1), axis=1), tl.max(tl.abs(k2), axis=1))
        scale = row_scales(absmax, MAX_ABS)
        k1, k2 = on_grid(k1, scale, MAX_ABS, IS_INT), on_grid(k2, scale, MAX_ABS, IS_INT)
        tl.store(k_scale_ptr + scale_index, scale, mask=head_mask)
    tl.store(k_cache, k1.to(k_cache.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache + HALF, k2.to(k_cache.dtype.element_ty), mask=kv_mask)


@triton.jit
def _store_v_heads(v, v_cache, v_scale_ptr, scale_index, v_mask, head_mask,
                   QUANTIZED: tl.constexpr, MAX_ABS: tl.constexpr, IS_INT: tl.constexpr):
    """The v heads (BLOCK_KV, BLOCK_D), zeros past HEAD_DIM, into the cache at v_cache."""
    if QUANTIZED:
        v = v.to(tl.float32)
        scale = row_scales(tl.max(tl.abs(v), axis=1), MAX_ABS)
        v = on_grid(v, scale, MAX_ABS, IS_INT)
        tl.store(v_scale_ptr + scale_index, scale, mask=head_mask)
    tl.store(v_cache, v.to(v_cache.dtype.element_ty), mask=v_mask)


@triton.jit
def _attention_input_kernel(
    qkv_ptr,  # (T, (heads + 2 * kv_heads) * HEAD_DIM), row stride stride_t: q, k, v heads
    q_norm_ptr,  # (HEAD_DIM,) when QK_NORM
    k_norm_ptr,
    cos_ptr,  # (T, HEAD_DIM): both halves equal, the first is read
    sin_ptr,
    q_out_ptr,  # (T, heads, HEAD_DIM), contiguous
    k_cache_ptr,  # (num_blocks, block_size, kv_heads, HEAD_DIM), contiguous
    v_cache_ptr,
    k_scale_ptr,  # (num_blocks, block_size, kv_heads) float16, contiguous, when QUANTIZED
    v_scale_ptr,
    slot_ptr,  # (T,) int64, below 0 for a padding token
    center_ptr,  # (kv_heads, HEAD_DIM) in the activation dtype, when CENTERED
    rotation_entry,  # the normalized Hadamard matrix's entry in the activation dtype, ROTATE
    scale_rows_ptr,  # (T, scale_size), row stride stride_s, when ROW_SCALE
    stride_t,
    stride_cos,
    stride_sin,
    stride_s,
    scale_size,
    scale_eps,
    eps,
    num_heads,
    num_kv_heads,
    QK_NORM: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK_S: tl.constexpr,  # scale_size padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # heads padded to a power of two
    BLOCK_KV: tl.constexpr,  # kv_heads padded to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_HALF: tl.constexpr,  # HEAD_DIM / 2 padded to a power of two
    QUANTIZED: tl.constexpr,  # int8 or e4m3 cache elements, scales beside them
    MAX_ABS: tl.constexpr,
    IS_INT: tl.constexpr,
    CENTERED: tl.constexpr,  # k heads stored less the layer's center
    ROTATE: tl.constexpr,  # q and k heads turned by the Hadamard matrix (HEAD_DIM a power of 2)
    LOG2_D: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + token * stride_t
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + offs, mask=offs < HALF, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin + offs, mask=offs < HALF, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    scale_row = scale_rows_ptr + token * stride_s
    q1, q2, row_scale = _normed_rotated_heads(
        row, q_norm_ptr, cos, sin, eps, num_heads, 1.0, scale_row, scale_size, scale_eps,
        QK_NORM, ROW_SCALE, ROW_SCALE, HEAD_DIM, BLOCK_Q, BLOCK_D, BLOCK_HALF, BLOCK_S,
    )  # fmt: skip
    q1, q2 = _hadamard(q1, q2, rotation_entry, BLOCK_Q, BLOCK_HALF, LOG2_D, ROTATE)
    heads = tl.arange(0, BLOCK_Q)[:, None]
    q_row = q_out_ptr + (token * num_heads + heads) * HEAD_DIM + offs
    q_mask = (heads < num_heads) & (offs < HALF)
    tl.store(q_row, q1, mask=q_mask)
    tl.store(q_row + HALF, q2, mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        k_row = row + num_heads * HEAD_DIM
        k1, k2, _ = _normed_rotated_heads(
            k_row, k_norm_ptr, cos, sin, eps, num_kv_heads, row_scale, scale_row, scale_size,
            scale_eps, QK_NORM, ROW_SCALE, False, HEAD_DIM, BLOCK_KV, BLOCK_D, BLOCK_HALF, BLOCK_S,
        )  # fmt: skip
        kv_heads = tl.arange(0, BLOCK_KV)[:, None]
        # int64: a large cache holds more than 2**31 elements
        cache_row = (slot * num_kv_heads + kv_heads) * HEAD_DIM
        kv_mask = (kv_heads < num_kv_heads) & (offs < HALF)
        heads_1d = tl.arange(0, BLOCK_KV)
        scale_index = slot * num_kv_heads + heads_1d
        head_mask = heads_1d < num_kv_heads
        k1, k2 = _centered(k1, k2, center_ptr, kv_heads, offs, kv_mask, HALF, CENTERED)
        k1, k2 = _hadamard(k1, k2, rotation_entry, BLOCK_KV, BLOCK_HALF, LOG2_D, ROTATE)
        _store_k_heads(k1, k2, k_cache_ptr + cache_row + offs, k_scale_ptr, scale_index, kv_mask,
                       head_mask, HALF, QUANTIZED, MAX_ABS, IS_INT)
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        v_mask = (kv_heads < num_kv_heads) & (offs_d < HEAD_DIM)
        v = tl.load(k_row + (num_kv_heads + kv_heads) * HEAD_DIM + offs_d, mask=v_mask,
                    other=0.0)
        v = _scaled(v, row_scale, ROW_SCALE)
        _store_v_heads(v, v_cache_ptr + cache_row + offs_d, v_scale_ptr, scale_index, v_mask,
                       head_mask, QUANTIZED, MAX_ABS, IS_INT)


def attention_input(
    qkv: torch.Tensor,  # (T, (heads + 2 * kv_heads) * head_dim)
    num_heads: int,
    cos: torch.Tensor,  # (T, head_dim)
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64
    q_norm: torch.Tensor | None = None,  # (head_dim,) per-head RMSNorm weights (Qwen3)
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    row_scale: tuple[torch.Tensor, float] | None = None,  # (rows (T, hidden), eps)
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, kv_heads): int8/e4m3 only
    v_scale: torch.Tensor | None = None,
    key_center: torch.Tensor | None = None,  # (kv_heads, head_dim): quantized caches only
    rotate: bool = False,  # a cache of Hadamard-rotated keys (head_dim a power of two)
) -> torch.Tensor:
    """q (T, heads, head_dim) for the attention kernel, after the optional per-head norms and
    rotary; k (normed and turned the same way) and v are written into the cache at each token's
    slot. The unfused equivalent: rms_norm of the q and k heads, rotary, store_kv. A cache of
    int8 or e4m3 elements takes k and v quantized, their scales into k_scale and v_scale.

    row_scale (rows, eps): each qkv row is first multiplied by 1 / RMS of the token's row of
    rows, for a qkv projection that took the layer's input before its RMSNorm.

    key_center: the k heads are stored less it (a quantized cache of centered keys).
    rotate: q comes back as q @ H and the (centered) keys are stored as k @ H, H the normalized
    head_dim Hadamard matrix (workers/attention/key_rotation.py)."""
    num_tokens, width = qkv.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv of shape {tuple(qkv.shape)} does not hold {num_heads} q heads "
                         f"and {num_kv_heads} k and v heads of {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q and k are normed together or not at all")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    scales = check_scales(k_cache, k_scale, v_scale)
    if key_center is not None and (k_scale is None or key_center.dtype != qkv.dtype
                                   or key_center.shape != (num_kv_heads, head_dim)
                                   or not key_center.is_contiguous()):
        raise ValueError(f"a key center must be a contiguous ({num_kv_heads}, {head_dim}) "
                         f"tensor of {qkv.dtype} beside a quantized cache")
    if head_dim % 2 or cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be ({num_tokens}, {head_dim}), head_dim even")
    scale_rows, scale_eps = row_scale if row_scale is not None else (qkv, 0.0)
    if scale_rows.dim() != 2 or scale_rows.shape[0] != num_tokens or scale_rows.stride(1) != 1:
        raise ValueError(f"row_scale's rows must be ({num_tokens}, hidden) with the last stride "
                         f"1, got {tuple(scale_rows.shape)}")
    if rotate and (head_dim & (head_dim - 1) or k_scale is None):
        raise ValueError(f"keys are rotated only into a quantized cache of a power-of-two "
                         f"head_dim, not {head_dim}")
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    _attention_input_kernel[(num_tokens,)](
        qkv,
        q_norm if q_norm is not None else qkv,
        k_norm if k_norm is not None else qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        *scales,
        slot_mapping,
        key_center if key_center is not None else qkv,
        hadamard_entry(head_dim, qkv.dtype) if rotate else 1.0,
        scale_rows,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        scale_rows.stride(0),
        scale_rows.shape[1],
        scale_eps,
        eps,
        num_heads,
        num_kv_heads,
        QK_NORM=q_norm is not None,
        ROW_SCALE=row_scale is not None,
        BLOCK_S=triton.next_power_of_2(scale_rows.shape[1]) if row_scale is not None else 1,
        HEAD_DIM=head_dim,
        BLOCK_Q=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        **quant_constants(k_cache),
        CENTERED=key_center is not None,
        ROTATE=rotate,
        LOG2_D=head_dim.bit_length() - 1 if rotate else 1,
    )
    return q


@functools.cache
def hadamard_entry(head_dim: int, dtype: torch.dtype) -> float:
    """The normalized Hadamard matrix's entry, 1 / sqrt(head_dim), as ``hadamard`` rounds it
    in ``dtype``: the kernel multiplies by what the matmul q @ H would."""
    return hadamard(head_dim, dtype)[0, 0].item()
