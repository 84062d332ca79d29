"""GPU check of the fused elementwise kernels: each against the plain PyTorch layer at real
shapes, whole models fused vs plain, and the time of a decode layer and of a decode step both
ways (CUDA graphs replayed, CUDA events, median).

Run on a CUDA machine:  python -m tools.kernels.check_fused
Every check runs even if an earlier one failed; the last line says ALL OK or lists failures.
"""

import statistics
import sys
import traceback

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config

from workers.attention.layer_cache import LayerKVCache
from workers.attention.metadata import AttentionMetadata
from workers.attention.triton_backend import TritonAttentionBackend
from workers.layers.attention_input import attention_input
from workers.layers.fused_kernels import add_rms_norm, rms_norm, silu_and_mul
from workers.layers.norm import RMSNorm
from workers.layers.parallel import TensorParallelGroup
from workers.layers.rotary import RotaryEmbedding, apply_rotary
from workers.models.llama import LlamaForCausalLM, head_dim_of

# fmt: off
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA_1B = LlamaConfig(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE)
QWEN3_06B = Qwen3Config(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0)
# fmt: on
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
NUM_TOKENS = (1, 256)
BLOCK_SIZE, PROMPT_LEN, DECODE_CONTEXT = 16, 128, 512
TIMED_RUNS = 200


def check_kernels(dtype: torch.dtype, num_tokens: int, device: str = "cuda") -> None:
    """Each kernel against the plain layer; raises on a mismatch."""

    def randn(*shape, dtype):
        return torch.randn(shape, device=device, dtype=dtype)

    tol = dict(atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    hidden, eps = LLAMA_1B.hidden_size, LLAMA_1B.rms_norm_eps
    norm = RMSNorm(hidden, eps).to(device, dtype)
    norm.weight.data = 1 + 0.1 * randn(hidden, dtype=dtype)
    x, residual = randn(num_tokens, hidden, dtype=dtype), randn(num_tokens, hidden, dtype=dtype)
    normed, new_residual = add_rms_norm(x, residual, norm.weight, eps)
    assert torch.equal(new_residual, x + residual), "residual differs from x + residual"
    torch.testing.assert_close(normed, norm(x + residual), **tol)
    torch.testing.assert_close(rms_norm(x, norm.weight, eps), norm(x), **tol)

    heads, kv_heads, head_dim = 16, 8, 128  # Qwen3-0.6B's attention input: norms, rotary, store
    qkv = randn(num_tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
    head_norm = RMSNorm(head_dim, 1e-6).to(device, dtype)
    head_norm.weight.data = 1 + 0.1 * randn(head_dim, dtype=dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    with torch.device(device):
        cos, sin = RotaryEmbedding(QWEN3_06B, head_dim)(positions, dtype)
    k_norm = RMSNorm(head_dim, 1e-6).to(device, dtype)
    k_norm.weight.data = 1 + 0.1 * randn(head_dim, dtype=dtype)
    expected_q = apply_rotary(head_norm(q), cos, sin)
    expected_k = apply_rotary(k_norm(k), cos, sin)
    caches = torch.zeros(2, num_tokens, 1, kv_heads, head_dim, device=device, dtype=dtype)
    slots = torch.arange(num_tokens, device=device)
    got_q = attention_input(qkv.flatten(1), heads, cos, sin, caches[0], caches[1], slots,
                            head_norm.weight, k_norm.weight, eps=1e-6)
    torch.testing.assert_close(got_q, expected_q, **tol)
    torch.testing.assert_close(caches[0, :, 0], expected_k, **tol)
    assert torch.equal(caches[1, :, 0], v), "v was not stored as it is"

    gate_up = 3 * randn(num_tokens, 2 * LLAMA_1B.intermediate_size, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, **tol)


def build_models(config, dtype: torch.dtype, device: str) -> tuple[LlamaForCausalLM, ...]:
    """(plain, fused) models with the same random weights (std 0.02, norms near 1)."""
    tp, backend = TensorParallelGroup.single(), TritonAttentionBackend()
    with torch.device(device):
        plain = LlamaForCausalLM(config, tp, backend, fused=False)
        fused = LlamaForCausalLM(config, tp, backend, fused=True)
    for name, param in plain.named_parameters():
        param.data.normal_(0, 0.02)
        if name.endswith("norm.weight"):
            param.data.add_(1.0)
    plain.to(dtype=dtype).eval()
    fused.to(dtype=dtype).eval()
    fused.load_state_dict(plain.state_dict())
    fused.model.fold_norm_weights()
    return plain, fused


def kv_caches(config, num_blocks: int, dtype: torch.dtype, device: str) -> list:
    shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, head_dim_of(config))
    return [
        LayerKVCache(
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype),
        )
        for _ in range(config.num_hidden_layers)
    ]


def metadata(start: int, end: int, device: str = "cuda") -> AttentionMetadata:
    """One sequence whose tokens [start, end) are new; its blocks are 0, 1, 2, ..."""
    num_blocks = -(-end // BLOCK_SIZE)
    return AttentionMetadata(
        slot_mapping=torch.arange(start, end, device=device),
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=end - start, max_seq_len=end,
        query_lens_cpu=[end - start], seq_lens_cpu=[end],
    )  # fmt: skip


@torch.inference_mode()
def compare_models(config, dtype: torch.dtype, device: str = "cuda", prompt_len=PROMPT_LEN) -> str:
    """Prefill prompt_len tokens then decode one, fused vs plain; raises when they differ."""
    plain, fused = build_models(config, dtype, device)
    ids = torch.randint(0, config.vocab_size, (prompt_len + 1,), device=device)
    logits = []
    for model in (plain, fused):
        caches = kv_caches(config, -(-(prompt_len + 1) // BLOCK_SIZE), dtype, device)
        for start, end in [(0, prompt_len), (prompt_len, prompt_len + 1)]:
            positions = torch.arange(start, end, device=device)
            hidden = model(ids[start:end], positions, caches, metadata(start, end, device))
        logits.append(model.compute_logits(hidden[-1:]).float())  # the decode row
    diff = (logits[0] - logits[1]).abs().max().item()
    same_argmax = torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    summary = f"max |logit diff| {diff:.3g} (max |logit| {logits[0].abs().max().item():.3g})"
    # bf16: 16-28 layers of 1-ulp rounding differences; the plain path rounds more often
    limit = 1e-3 if dtype == torch.float32 else 0.1 * logits[0].abs().max().item()
    if diff > limit:
        raise AssertionError(f"{summary} > {limit}, same argmax: {same_argmax}")
    return f"{summary}, same argmax: {same_argmax}"


def median_ms(fn, graph: bool) -> float:
    """Median time of fn (replayed from a CUDA graph when graph is set) over TIMED_RUNS."""
    fn()  # compiles the Triton kernels and sets up cuBLAS outside the capture
    torch.cuda.synchronize()
    run = fn
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fn()
        run = cuda_graph.replay
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(TIMED_RUNS)]  # fmt: skip
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


@torch.inference_mode()
def time_decode(config) -> list[str]:
    """A batch-1 decode at DECODE_CONTEXT through one layer and through the whole model."""
    plain, fused = build_models(config, torch.bfloat16, "cuda")
    caches = kv_caches(config, -(-DECODE_CONTEXT // BLOCK_SIZE), torch.bfloat16, "cuda")
    meta = metadata(DECODE_CONTEXT - 1, DECODE_CONTEXT)
    ids = torch.zeros(1, dtype=torch.int64, device="cuda")
    positions = torch.full((1,), DECODE_CONTEXT - 1, device="cuda")
    hidden = torch.randn(1, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    cos, sin = plain.model.rotary_emb(positions, torch.bfloat16)
    cache = caches[0]
    plain_layer, fused_layer = plain.model.layers[0], fused.model.layers[0]
    runs = {
        "layer plain": lambda: plain_layer(hidden, cos, sin, cache, meta),
        "layer fused": lambda: fused_layer.forward_one_token(
            hidden, residual, cos, sin, cache, meta
        ),
        "step plain": lambda: plain(ids, positions, caches, meta),
        "step fused": lambda: fused(ids, positions, caches, meta),
    }
    lines = []
    for name, fn in runs.items():
        for graph in (True, False):
            try:
                ms = median_ms(fn, graph)
                lines.append(f"{name:12s} {'graph' if graph else 'eager'}: {ms * 1e3:8.1f} µs")
            except Exception:  # noqa: BLE001 (report and go on to the next timing)
                lines.append(f"{name:12s} {'graph' if graph else 'eager'}: FAILED\n"
                             + traceback.format_exc())  # fmt: skip
    return lines


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    torch.manual_seed(0)
    failures = []

    def attempt(name: str, fn) -> None:
        try:
            result = fn()
            print(f"{name}: OK" + (f" ({result})" if result else ""))
        except Exception:  # noqa: BLE001 (report every failure, then go on)
            failures.append(name)
            print(f"{name}: FAILED\n{traceback.format_exc()}")

    for dtype in (torch.bfloat16, torch.float32):
        for num_tokens in NUM_TOKENS:
            check = lambda d=dtype, t=num_tokens: check_kernels(d, t)  # noqa: E731
            attempt(f"kernels {dtype} T={num_tokens}", check)
    for name, config in (("llama-3.2-1b", LLAMA_1B), ("qwen3-0.6b", QWEN3_06B)):
        for dtype in (torch.bfloat16, torch.float32):
            compare = lambda c=config, d=dtype: compare_models(c, d)  # noqa: E731
            attempt(f"model {name} {dtype} fused vs plain", compare)
    print(f"decode at batch 1, context {DECODE_CONTEXT}, bf16, median of {TIMED_RUNS}:")
    for name, config in (("llama-3.2-1b", LLAMA_1B), ("qwen3-0.6b", QWEN3_06B)):
        print(f"  {name}")
        try:
            for line in time_decode(config):
                print(f"    {line}")
                if "FAILED" in line:
                    failures.append(f"timing {name} {line.split(':')[0].strip()}")
        except Exception:  # noqa: BLE001
            failures.append(f"timing {name}")
            print(f"    FAILED\n{traceback.format_exc()}")
    print("ALL OK" if not failures else f"FAILED: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
