"""Quantized KV blocks (int8, e4m3) through the Triton kernels on the CPU (TRITON_INTERPRET=1)
against the PyTorch reference: the store kernels write the reference's bits, and the decode
and extend kernels, dequantizing in registers, give the reference's attention."""

# the interpreter fixture; TRITON_INTERPRET itself is set by conftest.py
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401, I001

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.workers.test_attention_input import (  # noqa: E402
    BLOCK_SIZE,
    HEADS,
    KV_HEADS,
    NUM_BLOCKS,
    expected,
    head_norms,
)
from tests.workers.test_fused_kernels import cos_sin, randn  # noqa: E402
from tests.workers.test_models import prefill_then_decode, prompt  # noqa: E402
from tests.workers.test_triton_attention import TOLERANCE, make_batch  # noqa: E402
from kvstore.kv_format import FP8, INT8  # noqa: E402
from workers.attention import reference  # noqa: E402
from workers.attention.key_centers import calibrate_key_centers  # noqa: E402
from workers.attention.key_rotation import hadamard, rotate  # noqa: E402
from workers.attention.kv_quant import dequantize, quantize  # noqa: E402
from workers.attention.layer_cache import LayerKVCache  # noqa: E402
from workers.attention.reference import ReferenceAttentionBackend, paged_attention  # noqa: E402
from workers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from workers.attention.triton_decode import decode_attention, default_tile  # noqa: E402
from workers.attention.triton_quant import conversion, dot_dtype  # noqa: E402
from workers.attention.triton_store import store_kv  # noqa: E402
from workers.layers.attention_input import attention_input  # noqa: E402
from workers.layers.parallel import TensorParallelGroup  # noqa: E402
from workers.loader import load_model  # noqa: E402
from workers.models.llama import head_dim_of  # noqa: E402

QUANTIZED = [torch.int8, torch.float8_e4m3fn]


def quantized(cache_k: torch.Tensor, cache_v: torch.Tensor, dtype) -> LayerKVCache:
    """Caches holding the given (random) blocks, quantized to ``dtype``."""
    (k, k_scale), (v, v_scale) = quantize(cache_k, dtype), quantize(cache_v, dtype)
    return LayerKVCache(k, v, k_scale, v_scale)


def copy(cache: LayerKVCache) -> LayerKVCache:
    return LayerKVCache(*(t.clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare float8 tensors exactly (and -0.0 apart from 0.0)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def assert_same_cache(got: LayerKVCache, want: LayerKVCache) -> None:
    for a, b in zip((got.k, got.v, got.k_scale, got.v_scale),
                    (want.k, want.v, want.k_scale, want.v_scale), strict=True):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_references_bits(dtype, activations):
    zeros = torch.zeros((4, 8, 2, 64))
    want = quantized(zeros, zeros, dtype)
    got = copy(want)
    qkv = (torch.randn((3, 3, 2, 64)) * torch.tensor([1.0, 30.0, 0.01])[:, None, None, None]
           ).to(activations)  # rows of very different magnitudes; k, v strided views
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([17, 3, 30])
    reference.store_kv(k, v, want.k, want.v, slots, want.k_scale, want.v_scale)
    store_kv(k, v, got.k, got.v, slots, got.k_scale, got.v_scale)
    assert_same_cache(got, want)
    assert torch.equal(want.k_scale.view(-1, 2)[slots], quantize(k, dtype)[1])


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_store_kv_skips_padding_slots_of_a_quantized_cache(dtype):
    zeros = torch.zeros((4, 8, 2, 64))
    cache = quantized(zeros, zeros, dtype)
    k, v = torch.randn((2, 2, 64)), torch.randn((2, 2, 64))
    store_kv(k, v, cache.k, cache.v, torch.tensor([-1, 5]), cache.k_scale, cache.v_scale)
    want = quantized(zeros, zeros, dtype)
    reference.store_kv(k[1:], v[1:], want.k, want.v, torch.tensor([5]), want.k_scale,
                       want.v_scale)
    assert_same_cache(cache, want)


CASES = {  # (seq_lens, q_lens, heads, kv_heads, head_dim, block_size)
    "decode, split contexts": ([1, 17, 300, 64], [1] * 4, 8, 2, 64, 16),
    "decode, odd group and head_dim": ([33, 270], [1, 1], 6, 2, 80, 16),
    "prefix hit, decode row, prefill, chunk": ([20, 40, 50, 70], [5, 1, 50, 16], 8, 2, 64, 16),
    "pure prefill, blocks of 8": ([7, 24], [7, 24], 4, 4, 64, 8),
    # an odd head count: a scale's 4-byte word holds it in either half (load_scales, which
    # decode and extend share)
    "decode, three kv heads": ([40, 17], [1, 1], 6, 3, 64, 16),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_backends_agree_on_quantized_blocks(case, dtype, activations):
    q, k, v, cache_k, cache_v, meta = make_batch(*CASES[case], activations, seed=5)
    want_cache = quantized(cache_k, cache_v, dtype)
    got_cache = copy(want_cache)
    scale = q.shape[-1] ** -0.5
    want = ReferenceAttentionBackend().forward(q, k, v, want_cache, meta, scale)
    got = TritonAttentionBackend().forward(q, k, v, got_cache, meta, scale)
    assert_same_cache(got_cache, want_cache)
    tol = TOLERANCE[activations]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_the_scales_of_every_split(num_splits):
    q, _, _, cache_k, cache_v, meta = make_batch([130, 9], [1, 1], 8, 2, 64, 8, torch.float32)
    cache = quantized(cache_k, cache_v, torch.int8)
    want = paged_attention(q, cache.k, cache.v, meta, 0.125, cache.k_scale, cache.v_scale)
    got = decode_attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, 0.125,
                           num_splits, k_scale=cache.k_scale, v_scale=cache.v_scale)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.int8, 0.01), (torch.float8_e4m3fn, 0.04)])
def test_attention_over_quantized_blocks_is_near_the_unquantized(dtype, tolerance):
    """The quantization's whole effect on one attention over random K and V (every element as
    large as any, the hard case for an absmax scale): the output moves by under 1% of its norm
    with int8 (0.7% measured), under 4% with e4m3 and its 3 mantissa bits (3%)."""
    q, _, _, cache_k, cache_v, meta = make_batch([300, 64, 20], [1, 1, 20], 8, 2, 64, 16,
                                                 torch.float32, seed=7)
    cache = quantized(cache_k, cache_v, dtype)
    exact = paged_attention(q, cache_k, cache_v, meta, 0.125)
    got = paged_attention(q, cache.k, cache.v, meta, 0.125, cache.k_scale, cache.v_scale)
    assert 0 < (got - exact).norm() / exact.norm() <= tolerance


def attention_input_case(qk_norm):
    """Five tokens (one padding) of a 32-wide head: the inputs and the plain layers' q, k, v."""
    head_dim = 32
    qkv = randn(5, (HEADS + 2 * KV_HEADS) * head_dim) * 4
    slots = torch.tensor([3, 17, -1, 0, 9])
    norms = head_norms(qk_norm, head_dim, torch.float32)
    cos, sin = cos_sin(5, head_dim, torch.float32)
    want_q, want_k, want_v = expected(qkv, head_dim, cos, sin, slots, norms, 1e-6, torch.float32)
    return head_dim, qkv, slots, norms, cos, sin, (want_q, want_k, want_v)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_input_quantizes_each_head_as_store_kv(dtype, qk_norm):
    head_dim, qkv, slots, norms, cos, sin, (want_q, want_k, want_v) = attention_input_case(qk_norm)
    zeros = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim)
    want = quantized(want_k, want_v, dtype)
    zero = quantized(zeros, zeros, dtype)
    got = copy(zero)
    q = attention_input(qkv, HEADS, cos, sin, got.k, got.v, slots, *(norms or (None, None)),
                        eps=1e-6, k_scale=got.k_scale, v_scale=got.v_scale)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    # v goes in as it is: the same bits; k is turned by rotary in the kernel's own rounding
    # (within 1e-5 of the plain layers'), then quantized within the format's bound
    assert torch.equal(bits(got.v), bits(want.v)) and torch.equal(got.v_scale, want.v_scale)
    step = got.k_scale.double()[..., None]
    bound = step / 2 if dtype == torch.int8 else want_k.double().abs() / 16 + step / 1024
    k_error = (dequantize(got.k, got.k_scale, torch.float32).double() - want_k.double()).abs()
    assert (k_error <= bound + 1e-5).all()
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for scale in (got.k_scale, got.v_scale):
        assert torch.equal(scale.view(-1, KV_HEADS)[untouched],
                           zero.k_scale.view(-1, KV_HEADS)[untouched])


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("centered", [False, True])
def test_rotate_stores_k_times_h_and_returns_q_times_h_in_one_launch(dtype, qk_norm, centered):
    """A cache of rotated keys (int8's): the kernel turns q and the (centered) k heads by H
    with a Walsh-Hadamard transform in registers, as ``rotate`` and ``stored_keys`` would."""
    head_dim, qkv, slots, norms, cos, sin, (want_q, want_k, want_v) = attention_input_case(qk_norm)
    h = hadamard(head_dim)
    center = randn(KV_HEADS, head_dim, seed=5) * 3 if centered else None
    kept = slots[slots >= 0]
    want_k = want_k.clone()
    rows = want_k.view(-1, KV_HEADS, head_dim)
    rows[kept] = rotate(rows[kept] - (center if centered else 0), h)
    want = quantized(want_k, want_v, dtype)
    zeros = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim)
    zero = quantized(zeros, zeros, dtype)
    got = copy(zero)
    q = attention_input(qkv, HEADS, cos, sin, got.k, got.v, slots, *(norms or (None, None)),
                        eps=1e-6, k_scale=got.k_scale, v_scale=got.v_scale, key_center=center,
                        rotate=True)
    torch.testing.assert_close(q, rotate(want_q, h), atol=2e-5, rtol=1e-5)
    assert torch.equal(bits(got.v), bits(want.v)) and torch.equal(got.v_scale, want.v_scale)
    step = got.k_scale.double()[..., None]  # k: rotary's rounding apart, within the bound
    bound = step / 2 if dtype == torch.int8 else want_k.double().abs() / 16 + step / 1024
    k_error = (dequantize(got.k, got.k_scale, torch.float32).double() - want_k.double()).abs()
    assert (k_error <= bound + 2e-5).all()
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[kept] = False  # the padding token (slot -1) wrote nothing
    for scale in (got.k_scale, got.v_scale):
        assert torch.equal(scale.view(-1, KV_HEADS)[untouched],
                           zero.k_scale.view(-1, KV_HEADS)[untouched])


def test_rotation_needs_a_power_of_two_head_dim_and_a_quantized_cache():
    qkv = torch.zeros(2, (HEADS + 2 * KV_HEADS) * 24)
    cos, sin = cos_sin(2, 24, torch.float32)
    cache = quantized(*(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 24),) * 2, torch.int8)
    message = ("^keys are rotated only into a quantized cache of a power-of-two head_dim, not "
               "{}$")
    with pytest.raises(ValueError, match=message.format(24)):
        attention_input(qkv, HEADS, cos, sin, cache.k, cache.v, torch.tensor([0, 1]),
                        k_scale=cache.k_scale, v_scale=cache.v_scale, rotate=True)
    plain = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 32)
    cos, sin = cos_sin(2, 32, torch.float32)
    with pytest.raises(ValueError, match=message.format(32)):
        attention_input(torch.zeros(2, (HEADS + 2 * KV_HEADS) * 32), HEADS, cos, sin, plain,
                        plain.clone(), torch.tensor([0, 1]), rotate=True)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_input_stores_k_less_the_center_into_an_fp8_cache(qk_norm):
    """fp8's centered keys: the kernel subtracts the layer's center from each rotary-turned k
    head before quantizing it, as ``stored_keys`` does; q and v are as without a center."""
    head_dim, qkv, slots, norms, cos, sin, (want_q, want_k, want_v) = attention_input_case(qk_norm)
    center = randn(KV_HEADS, head_dim, seed=5) * 3
    kept = slots[slots >= 0]
    want_k = want_k.clone()  # the stored keys, as the plain layers leave them
    want_k.view(-1, KV_HEADS, head_dim)[kept] -= center
    want = quantized(want_k, want_v, torch.float8_e4m3fn)
    zeros = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim)
    got = copy(quantized(zeros, zeros, torch.float8_e4m3fn))
    q = attention_input(qkv, HEADS, cos, sin, got.k, got.v, slots, *(norms or (None, None)),
                        eps=1e-6, k_scale=got.k_scale, v_scale=got.v_scale, key_center=center)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    assert torch.equal(bits(got.v), bits(want.v)) and torch.equal(got.v_scale, want.v_scale)
    step = got.k_scale.double()[..., None]
    k_error = (dequantize(got.k, got.k_scale, torch.float32).double() - want_k.double()).abs()
    assert (k_error <= want_k.double().abs() / 16 + step / 1024 + 1e-5).all()
    assert torch.equal(got.k_scale.view(-1, KV_HEADS)[kept], want.k_scale.view(-1, KV_HEADS)[kept])
    with pytest.raises(ValueError, match=r"^a key center must be a contiguous \(2, 32\) tensor "
                                         r"of torch.float32 beside a quantized cache$"):
        attention_input(qkv, HEADS, cos, sin, got.k, got.v, slots, k_scale=got.k_scale,
                        v_scale=got.v_scale, key_center=center[:1])
    with pytest.raises(ValueError, match="^a key center must be"):
        attention_input(qkv, HEADS, cos, sin, zeros.clone(), zeros.clone(), slots,
                        key_center=center)


def test_one_byte_elements_take_16_kb_steps_split_or_not():
    # the bytes of bfloat16's 8,192-value steps (64 tokens at head_dim 128)
    assert default_tile(1, 128, 1) == default_tile(4, 128, 1) == (128, 4, 3)
    assert default_tile(1, 128, 2) == (64, 4, 3)
    assert default_tile(1, 64, 1) == (128, 4, 3)  # capped at 128 tokens
    assert default_tile(4, 128) == (64, 4, 3)  # bfloat16 split contexts: 64-token steps


def test_quantized_dots_take_float16_and_the_measured_conversions():
    assert str(dot_dtype(torch.bfloat16, torch.int8)) == "fp16"
    assert str(dot_dtype(torch.float16, torch.float8_e4m3fn)) == "fp16"
    assert str(dot_dtype(torch.bfloat16, torch.bfloat16)) == "bf16"
    assert str(dot_dtype(torch.float32, torch.int8)) == "fp32"
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert conversion(gpu, torch.int8) == conversion(gpu, torch.int8, one_split=True) == "asm"
    assert conversion(gpu, torch.float8_e4m3fn) == "asm"
    assert conversion(gpu, torch.float8_e4m3fn, one_split=True) == "cast"
    assert conversion(cpu, torch.int8) == "cast"  # the interpreter runs no PTX


def test_a_quantized_cache_needs_its_scales():
    zeros = torch.zeros((4, 8, 2, 64))
    cache = quantized(zeros, zeros, torch.int8)
    k = torch.randn((1, 2, 64))
    message = "a torch.int8 cache needs scales exactly when it is quantized"
    with pytest.raises(ValueError, match=f"^{message}$"):
        store_kv(k, k, cache.k, cache.v, torch.tensor([0]))
    q, _, _, _, _, meta = make_batch([9], [1], 4, 2, 64, 8, torch.float32)
    with pytest.raises(ValueError, match=f"^{message}$"):
        decode_attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, 0.1, 1,
                         k_scale=cache.k_scale)
    with pytest.raises(ValueError, match="^K and V are quantized together or not at all$"):
        LayerKVCache(cache.k, cache.v, cache.k_scale)


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # one-row qkv + store kernel; q/k norms
@pytest.mark.parametrize("fmt", [INT8, FP8])
def test_a_fused_model_on_a_quantized_cache_matches_the_plain_one(tiny_models, name, fmt):
    """Fused on the Triton backend, the attention input quantizes K and V (the one-row decode
    step too, which leaves the qkv + store kernel for it), int8's after rotating k by H
    (head_dim 16 and 32); plain on the reference backend, PyTorch rotates, stores and attends.
    Both read the same blocks."""
    def load(fused):
        tp = TensorParallelGroup.single()
        backend = TritonAttentionBackend() if fused else ReferenceAttentionBackend()
        return load_model(tiny_models[name], torch.float32, "cpu", tp, backend, fused=fused)

    (plain, config), (fused, _) = load(False), load(True)
    ids = prompt(config.vocab_size)
    assert fmt.rotates_keys(head_dim_of(config)) == (fmt == INT8)  # fp8 keys: unrotated
    # centers as a calibration makes them (int8 subtracts before rotating, fp8 in the kernel)
    centers = calibrate_key_centers(plain, config, TensorParallelGroup.single(), torch.float32,
                                    torch.device("cpu"))
    for key_centers in (None, centers):
        want = prefill_then_decode(plain, config, ids, kv_format=fmt, key_centers=key_centers)
        got = prefill_then_decode(fused, config, ids, kv_format=fmt, key_centers=key_centers)
        # fp8 centered (llama): one e4m3 key element of 1,024 rounds the other way, the kernel's
        # rotary differing from torch's in the last bit; a step of 1/16 of it moves the logits
        atol = 1e-3 if fmt == FP8 and key_centers is not None else 5e-5
        for g, w in zip(got, want, strict=True):  # [prefill logits, decode logits]
            torch.testing.assert_close(g, w, atol=atol, rtol=1e-5)
