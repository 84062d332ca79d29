"""Centered keys: the calibration, an int8 cache storing (k - m) @ H and an fp8 cache k - m,
and the attention staying that of the unquantized keys, closer than without the centers where
keys share a big offset (Qwen2.5's k_proj bias)."""

import pytest
import torch

from kvstore.kv_format import FP8, INT8, kv_format
from tests.workers.test_key_rotation import prefill
from tests.workers.test_models import PROMPT_LEN, load_ours, metadata, prompt
from workers.attention.key_centers import (
    CALIBRATION_TOKENS,
    calibrate_key_centers,
    calibration_ids,
    centers_digest,
    key_centers_for,
)
from workers.attention.key_rotation import hadamard
from workers.attention.kv_quant import dequantize
from workers.attention.layer_cache import LayerKVCache
from workers.attention.metadata import whole_sequence
from workers.kv_cache import allocate_kv_caches
from workers.layers.parallel import TensorParallelGroup

SINGLE = TensorParallelGroup.single()
CPU = torch.device("cpu")


# the two slowest rotary pairs of head_dim 16 (rope_theta 10,000): an offset there turns by
# less than 0.2 rad over 512 positions, so all keys share it, as Qwen2.5's bias is shared
SLOW_CHANNELS = [6, 7, 14, 15]


def qwen2_with_a_key_offset(tiny_models, offset: float):
    """The tiny Qwen2 (q/k/v biases) with ``offset`` added to the k_proj bias of its slow
    rotary channels, in every kv head and layer."""
    model, config = load_ours(tiny_models["qwen2"])
    for layer in model.model.layers:
        qkv = layer.self_attn.qkv_proj
        with torch.no_grad():
            k_bias = qkv.bias[qkv.q_size:qkv.q_size + qkv.kv_size].view(-1, 16)
            k_bias[:, SLOW_CHANNELS] += offset
    return model, config


def test_the_calibration_prompt_is_fixed_and_centers_are_the_mean_stored_key(tiny_models):
    assert torch.equal(calibration_ids(1000, 8), calibration_ids(1000, 8))
    assert calibration_ids(1000, 8).tolist() == torch.randint(
        0, 1000, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    model, config = qwen2_with_a_key_offset(tiny_models, 0.0)
    centers = calibrate_key_centers(model, config, SINGLE, torch.float32, CPU)
    # the same prefill into a float32 cache: its keys' mean over the tokens, per layer
    num_tokens = min(CALIBRATION_TOKENS, config.max_position_embeddings)
    caches = allocate_kv_caches(config, 1, num_tokens // 4, 4, torch.float32, CPU)
    with torch.no_grad():
        model(calibration_ids(config.vocab_size, num_tokens), torch.arange(num_tokens), caches,
              whole_sequence(num_tokens, 4, CPU))
    assert len(centers) == config.num_hidden_layers
    for center, cache in zip(centers, caches, strict=True):
        assert center.shape == (2, 16) and center.dtype == torch.float32
        torch.testing.assert_close(center, cache.k.flatten(0, 1).mean(0), atol=1e-5, rtol=0)


def test_int8_of_a_power_of_two_head_dim_and_fp8_of_any_center(tiny_models):
    model, config = load_ours(tiny_models["qwen2"])
    assert key_centers_for(kv_format("auto", "float32"), model, config, SINGLE, torch.float32,
                           CPU) is None
    assert len(key_centers_for(INT8, model, config, SINGLE, torch.float32, CPU)) == 2
    assert len(key_centers_for(FP8, model, config, SINGLE, torch.float32, CPU)) == 2
    assert INT8.centers_keys(64) and not INT8.centers_keys(80)  # unrotated int8: as it is
    assert FP8.centers_keys(64) and FP8.centers_keys(80) and not FP8.rotates_keys(64)


def test_the_digest_names_the_centers_to_the_bit(tiny_models):
    model, config = load_ours(tiny_models["qwen2"])
    centers = calibrate_key_centers(model, config, SINGLE, torch.float32, CPU)
    again = calibrate_key_centers(model, config, SINGLE, torch.float32, CPU)
    digest = centers_digest(centers, SINGLE)
    assert digest == centers_digest(again, SINGLE) and len(digest) == 16
    int(digest, 16)  # hex digits
    moved = [centers[0], centers[1].clone()]
    moved[1][0, 0] = torch.nextafter(moved[1][0, 0], torch.tensor(float("inf")))
    assert centers_digest(moved, SINGLE) != digest
    assert centers_digest(None, SINGLE) is None


def test_a_center_that_does_not_fit_or_has_no_quantized_cache_is_refused():
    zeros = torch.zeros((4, 8, 2, 16), dtype=torch.int8)
    scales = torch.zeros((4, 8, 2), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^a key center of shape \(3, 16\) does not fit 2 kv "
                                         r"heads of head_dim 16$"):
        LayerKVCache(zeros, zeros, scales, scales, hadamard(16), torch.zeros(3, 16))
    with pytest.raises(ValueError, match="^keys are centered only in a quantized cache$"):
        LayerKVCache(zeros.float(), zeros.float(), key_center=torch.zeros(2, 16))
    LayerKVCache(zeros, zeros, scales, scales, None, torch.zeros(2, 16))  # fp8's: unrotated


def test_a_wrong_number_of_centers_is_refused(tiny_models):
    _, config = load_ours(tiny_models["qwen2"])
    with pytest.raises(ValueError, match="^1 key centers for 2 layers$"):
        allocate_kv_caches(config, 1, 4, 4, torch.float32, CPU, INT8, [torch.zeros(2, 16)])


def prefill_centered(model, config, ids, centers, fmt=INT8):
    caches = allocate_kv_caches(config, 1, 8, 4, torch.float32, CPU, fmt, centers)
    with torch.no_grad():
        hidden = model(ids[:PROMPT_LEN], torch.arange(PROMPT_LEN), caches,
                       metadata(0, PROMPT_LEN))
        return model.compute_logits(hidden), caches


def test_centered_keys_are_stored_less_the_center_and_attend_as_the_exact_ones(tiny_models):
    """Keys sharing an offset of 30 in four channels: uncentered, int8 spends its steps on
    the offset; centered (the softmax does not see m) the logits come 4x closer to the float32
    cache's (3x asserted)."""
    model, config = qwen2_with_a_key_offset(tiny_models, 30.0)
    ids = prompt(config.vocab_size)
    centers = calibrate_key_centers(model, config, SINGLE, torch.float32, CPU)
    exact, exact_caches = prefill(model, config, ids, None)
    plain, _ = prefill(model, config, ids, INT8)  # rotated, uncentered
    got, caches = prefill_centered(model, config, ids, centers)
    layer, want = caches[0], exact_caches[0]  # the first layer's input is the same in all
    assert torch.equal(layer.key_center, centers[0])
    h = hadamard(16)
    half_step = layer.k_scale.float()[..., None] / 2
    keys = dequantize(layer.k, layer.k_scale, torch.float32)
    stored = [s for s in range(32) if want.k.flatten(0, 1)[s].abs().sum() > 0]  # written slots
    want_keys = ((want.k - centers[0]) @ h).flatten(0, 1)[stored]
    assert ((keys.flatten(0, 1)[stored] - want_keys).abs()
            <= half_step.flatten(0, 1)[stored] + 1e-5).all()
    centered_error = (got - exact).norm() / exact.norm()
    plain_error = (plain - exact).norm() / exact.norm()
    assert centered_error < plain_error / 3  # 0.017 against 0.075
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


def test_fp8_keys_are_stored_less_the_center_unrotated_and_attend_closer(tiny_models):
    """The same keys in an fp8 cache: e4m3 keeps 3 mantissa bits of each element, so an
    offset of 30 sets the step of the channels it sits in; centered, those channels hold only
    what differs between keys and the logits come closer to the float32 cache's."""
    model, config = qwen2_with_a_key_offset(tiny_models, 30.0)
    ids = prompt(config.vocab_size)
    centers = calibrate_key_centers(model, config, SINGLE, torch.float32, CPU)
    exact, exact_caches = prefill(model, config, ids, None)
    plain, _ = prefill(model, config, ids, FP8)  # no centers given: stored as they are
    got, caches = prefill_centered(model, config, ids, centers, FP8)
    layer, want = caches[0], exact_caches[0]
    assert layer.key_rotation is None and torch.equal(layer.key_center, centers[0])
    stored = [s for s in range(32) if want.k.flatten(0, 1)[s].abs().sum() > 0]
    want_keys = (want.k - centers[0]).flatten(0, 1)[stored]  # unrotated
    keys = dequantize(layer.k, layer.k_scale, torch.float32).flatten(0, 1)[stored]
    scale = layer.k_scale.float().flatten(0, 1)[stored][..., None]
    assert ((keys - want_keys).abs() <= want_keys.abs() / 16 + scale / 1024 + 1e-6).all()
    centered_error = (got - exact).norm() / exact.norm()
    plain_error = (plain - exact).norm() / exact.norm()
    assert centered_error < plain_error / 4  # 0.070 against 0.343


@pytest.mark.gpu
def test_on_a_gpu_the_fused_kernels_calibrate_the_reference_s_centers_and_graphs_replay_them(
        tiny_models):
    """bfloat16 on the GPU, the Triton kernels storing the calibration's keys: the centers are
    the CPU float32 reference's within bfloat16's rounding; an int8 engine with CUDA graphs
    gives the tokens of one without them, and its blocks' keys carry the digest."""
    from cluster import LLM, SamplingParams
    from workers.attention.triton_backend import TritonAttentionBackend
    from workers.loader import load_model

    model, config = qwen2_with_a_key_offset(tiny_models, 0.0)
    want = calibrate_key_centers(model, config, SINGLE, torch.float32, CPU)
    gpu, _ = load_model(tiny_models["qwen2"], torch.bfloat16, "cuda", SINGLE,
                        TritonAttentionBackend())
    got = calibrate_key_centers(gpu, config, SINGLE, torch.bfloat16, torch.device("cuda"))
    for center, reference in zip(got, want, strict=True):
        assert center.device.type == "cuda" and center.dtype == torch.bfloat16
        torch.testing.assert_close(center.float().cpu(), reference, atol=0.05, rtol=0.02)
    prompts = [[(31 * p + 7 * i) % 990 + 5 for i in range(40 + p)] for p in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64,
                  max_num_seqs=8, kv_cache_dtype="int8")
    eager = LLM(str(tiny_models["qwen2"]), enforce_eager=True, **common)
    graphs = LLM(str(tiny_models["qwen2"]), **common)
    assert graphs.engine.executor.worker.graphs is not None
    assert [o.token_ids for o in graphs.generate(prompts, greedy)] == [
        o.token_ids for o in eager.generate(prompts, greedy)]
    assert graphs.engine.kv_hash_keys[1][-1].startswith("key-centers=")
