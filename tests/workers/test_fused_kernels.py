"""The fused elementwise Triton kernels on the CPU (TRITON_INTERPRET=1) against the plain
PyTorch layers, and whole models built with fused=True against fused=False."""

# the interpreter fixture; TRITON_INTERPRET itself is set by conftest.py
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401, I001

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.workers.gloo_group import gloo_group  # noqa: E402
from tests.workers.test_models import (  # noqa: E402
    check_tp_2_against_tp_1,
    prefill_then_decode,
    prompt,
)
from tests.workers.triton_interpreter import patched_interpreter  # noqa: E402
from workers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from workers.layers.fused_kernels import (  # noqa: E402
    add_rms_norm,
    rms_norm,
    silu_and_mul,
)
from workers.layers.linear import RowParallelLinear  # noqa: E402
from workers.layers.norm import RMSNorm  # noqa: E402
from workers.layers.parallel import TensorParallelGroup  # noqa: E402
from workers.loader import fused_kernels_by_default, load_model  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# bfloat16 is looser: the interpreter truncates to it where a GPU rounds (1 ulp = 2 ** -8)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_close(got, expected, dtype):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def plain_norm(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.data = weight
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])  # 48: a row narrower than its power-of-two block
def test_add_rms_norm(dtype, hidden):
    x, residual = randn(5, hidden, dtype=dtype), randn(5, hidden, dtype=dtype, seed=1)
    weight, eps = 1 + 0.2 * randn(hidden, dtype=dtype, seed=2), 1e-6
    normed, new_residual = add_rms_norm(x, residual, weight, eps)
    expected_residual = x + residual
    if dtype == torch.bfloat16:  # the interpreter truncates float32 to bfloat16; a GPU rounds
        assert_close(new_residual, expected_residual, dtype)
    else:
        assert torch.equal(new_residual, expected_residual)
    assert_close(normed, plain_norm(weight, eps)(expected_residual), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_hidden_states(dtype):
    x, weight = randn(3, 64, dtype=dtype), 1 + 0.2 * randn(64, dtype=dtype, seed=2)
    assert_close(rms_norm(x, weight, 1e-5), plain_norm(weight, 1e-5)(x), dtype)


def cos_sin(num_tokens: int, head_dim: int, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(3, 3 + num_tokens).float()[:, None] * inv_freq  # (T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 2 * 1500])  # 1500: two programs a row, the last masked
def test_silu_and_mul(dtype, width):
    gate_up = 3 * randn(3, width, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(silu_and_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 2 * 5000])  # 5000: two programs a row, the last masked
def test_silu_and_mul_with_row_scale(dtype, width):
    """gate_up of the unnormalized rows (the norm's weight folded into it), then row_scale = SiLU
    * up of the normed rows' gate_up."""
    gate_up, rows, eps = 3 * randn(3, width, dtype=dtype), randn(3, 40, dtype=dtype, seed=1), 1e-6
    rows[1] *= 50  # rows far from unit RMS
    inverse_rms = torch.rsqrt(rows.float().pow(2).mean(-1, keepdim=True) + eps)
    gate, up = (gate_up.float() * inverse_rms).to(dtype).chunk(2, dim=-1)
    got, want = silu_and_mul(gate_up, row_scale=(rows, eps)), F.silu(gate) * up
    # one rounding more than without the scale (the scaled gate and up): twice the tolerance
    tol = 2 * TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match=r"row_scale's rows must be \(3, hidden\) with the last "
                                         r"stride 1, got \(40,\)"):
        silu_and_mul(gate_up, row_scale=(rows[0], eps))


def test_empty_batch():
    assert rms_norm(torch.empty(0, 64), torch.ones(64), 1e-6).shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 128), row_scale=(torch.empty(0, 32), 1e-6)).shape == (0, 64)


def test_rms_norm_takes_rows_only():
    with pytest.raises(ValueError, match=r"RMSNorm takes rows \(T, N\) with the last stride 1, "
                                         r"got \(2, 3, 64\)"):
        rms_norm(torch.zeros(2, 3, 64), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match=r"residual \(2, 32\) does not match \(2, 64\)"):
        add_rms_norm(torch.zeros(2, 64), torch.zeros(2, 32), torch.ones(64), 1e-6)


def test_fused_by_default_only_on_cuda_with_the_triton_backend():
    assert not fused_kernels_by_default("cpu", TritonAttentionBackend())
    assert fused_kernels_by_default("cuda", TritonAttentionBackend())


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2"])  # per-head q/k norms; qkv bias
def test_fused_model_matches_plain(tiny_models, name):
    def load(fused):
        tp, backend = TensorParallelGroup.single(), TritonAttentionBackend()
        return load_model(tiny_models[name], torch.float32, "cpu", tp, backend, fused=fused)

    (plain, config), (fused, _) = load(False), load(True)
    assert fused.model.fused and not plain.model.fused
    ids = prompt(config.vocab_size)
    expected = prefill_then_decode(plain, config, ids)  # [prefill logits, decode logits]
    # float32 apart from summation order and the norm weights folded into qkv and gate_up
    # (a rounding more per weight): logits of magnitude ~6 differ by ~1.5e-5
    for got, want in zip(prefill_then_decode(fused, config, ids), expected, strict=True):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


def load_tiny(folder, fused: bool):
    tp, backend = TensorParallelGroup.single(), TritonAttentionBackend()
    return load_model(folder, torch.float32, "cpu", tp, backend, fused=fused)


def test_folding_the_norm_weights_keeps_the_function(tiny_models):
    model, config = load_tiny(tiny_models["qwen3"], fused=False)
    ids = prompt(config.vocab_size)
    expected = prefill_then_decode(model, config, ids)
    layer = model.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    want_qkv = qkv * layer.input_layernorm.weight
    want_gate_up = gate_up * layer.post_attention_layernorm.weight
    final_norm = model.model.norm.weight.clone()
    model.model.fold_norm_weights()
    model.model.fold_norm_weights()  # idempotent: the norms' weights are 1 after the first
    assert torch.equal(qkv, want_qkv) and torch.equal(gate_up, want_gate_up)
    assert torch.equal(layer.input_layernorm.weight, torch.ones(config.hidden_size))
    assert torch.equal(layer.post_attention_layernorm.weight, torch.ones(config.hidden_size))
    assert torch.equal(model.model.norm.weight, final_norm)  # the LM head's norm keeps its own
    for got, want in zip(prefill_then_decode(model, config, ids), expected, strict=True):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


def test_a_fused_model_runs_only_with_its_norm_weights_folded(tiny_models):
    model, config = load_tiny(tiny_models["llama"], fused=True)
    assert model.model.norms_folded  # load_weights folds them
    model.load_state_dict(model.state_dict())  # a state dict may hold a checkpoint's weights
    assert not model.model.norms_folded
    message = ("a fused model runs with its norm weights folded into its projections: call "
               "fold_norm_weights() after loading weights")
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        prefill_then_decode(model, config, prompt(config.vocab_size))


def test_row_parallel_add_into_adds_in_place():
    linear = RowParallelLinear(6, 4, TensorParallelGroup.single())
    linear.weight.data = randn(4, 6)
    residual, x = randn(3, 4, seed=1), randn(3, 6, seed=2)
    expected = residual + x @ linear.weight.t()
    assert linear.add_into(residual, x) is residual
    torch.testing.assert_close(residual, expected, atol=1e-6, rtol=1e-6)


def fused_tp_worker(rank: int, store_file: str, folders: list) -> None:
    with patched_interpreter(), gloo_group(rank, 2, store_file) as tp:
        for folder in folders:
            model, config = load_model(folder, torch.float32, "cpu", tp, TritonAttentionBackend(),
                                       fused=True)
            logits = prefill_then_decode(model, config, prompt(config.vocab_size), tp_size=2)
            torch.save(logits, f"{folder}/logits_rank{rank}.pt")


def test_fused_tensor_parallel_2_matches_plain_tp_1(tmp_path):
    """The fused kernels at TP 2 (the decode step's one-row kernels on each rank's shard, the
    row-parallel sums over gloo): biases everywhere, a KV head replicated on both ranks, Qwen3's
    per-head norms, vocabularies that need padding — logits of TP 1's plain layers."""
    check_tp_2_against_tp_1(tmp_path, fused_tp_worker)
