"""GPU check of the quantized KV cache (int8, e4m3): the compiled store kernel against the
PyTorch reference bit for bit, the decode and extend kernels over quantized blocks against the
reference's attention, and greedy tokens through the engine, Triton (fused kernels, CUDA
graphs) against the reference backend, in float32 on a small random Llama.

Run on a CUDA machine:  python -m tools.kernels.check_kv_quant
Every check runs even if an earlier one failed; the last line says ALL OK or lists failures.
"""

import sys
import tempfile
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from cluster import LLM, SamplingParams
from workers.attention import reference
from workers.attention.kv_quant import quantize
from workers.attention.layer_cache import LayerKVCache
from workers.attention.metadata import AttentionMetadata
from workers.attention.reference import ReferenceAttentionBackend
from workers.attention.triton_backend import TritonAttentionBackend
from workers.attention.triton_store import store_kv

ELEMENTS = (torch.int8, torch.float8_e4m3fn)
BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 16, 32, 8, 128


def batch(seq_lens: list[int], q_lens: list[int], dtype: torch.dtype):
    """q, k, v of the new tokens and metadata over blocks given out in a shuffled order."""
    gen = torch.Generator().manual_seed(0)
    per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    order = torch.randperm(sum(per_seq) + 2, generator=gen).tolist()
    tables = torch.zeros((len(seq_lens), max(per_seq)), dtype=torch.int32)
    slots = []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        owned = [order.pop() for _ in range(per_seq[i])]
        tables[i, : len(owned)] = torch.tensor(owned)
        slots += [owned[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in range(seq_len - q_len, seq_len)]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots).cuda(), starts.cuda(),
                             torch.tensor(seq_lens, dtype=torch.int32).cuda(), tables.cuda(),
                             max(q_lens), max(seq_lens), list(q_lens), list(seq_lens))
    tokens = sum(q_lens)
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, generator=gen).to(dtype).cuda()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    shape = (sum(per_seq) + 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return q, k, v, torch.randn(shape, generator=gen).cuda(), meta


def quantized(values: torch.Tensor, element: torch.dtype) -> LayerKVCache:
    (k, k_scale), (v, v_scale) = quantize(values, element), quantize(values.flip(0), element)
    return LayerKVCache(k, v, k_scale, v_scale)


def copy(cache: LayerKVCache) -> LayerKVCache:
    return LayerKVCache(*(t.clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)))


def differing(a: LayerKVCache, b: LayerKVCache) -> int:
    pairs = zip((a.k, a.v, a.k_scale, a.v_scale), (b.k, b.v, b.k_scale, b.v_scale), strict=True)
    return sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum()) for x, y in pairs)


def check_kernels(element: torch.dtype, dtype: torch.dtype) -> str:
    """Both backends over the same quantized blocks: a prefix hit, a prefill, a chunk and
    decode rows (extend kernel), then decode rows alone (split decode kernel)."""
    lines = []
    for seq_lens, q_lens in (([300, 40, 1000, 70], [20, 1, 1000, 16]), ([300, 4000, 17], [1] * 3)):
        q, k, v, values, meta = batch(seq_lens, q_lens, dtype)
        want = quantized(values, element)
        got = copy(want)
        scale = HEAD_DIM**-0.5
        expected = ReferenceAttentionBackend().forward(q, k, v, want, meta, scale).float()
        out = TritonAttentionBackend().forward(q, k, v, got, meta, scale).float()
        diff = (out - expected).abs().max().item()
        bad = differing(got, want)
        # H200, float32: 4 of 4.4 M e4m3 bytes one step from torch's conversion (none in bf16),
        # and the attention 6e-4 apart for it
        exact = element == torch.int8 or dtype != torch.float32
        tol = 1e-4 if dtype == torch.float32 and exact else 2e-2
        lines.append(f"{'decode' if max(q_lens) == 1 else 'extend'}: max |diff| {diff:.2e}, "
                     f"{bad} cache bytes differ")
        if diff > tol or bad > (0 if exact else want.k.numel() * 1e-5):
            raise AssertionError("; ".join(lines))
    return "; ".join(lines)


def check_store(element: torch.dtype) -> str:
    zeros = torch.zeros(8, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda")
    want = quantized(zeros, element)
    got = copy(want)
    k = torch.randn(64, KV_HEADS, HEAD_DIM, device="cuda") * torch.logspace(
        -3, 3, 64, device="cuda")[:, None, None]  # magnitudes 1e-3 .. 1e3
    slots = torch.randperm(8 * BLOCK_SIZE, device="cuda")[:64]
    reference.store_kv(k, k.flip(1), want.k, want.v, slots, want.k_scale, want.v_scale)
    store_kv(k, k.flip(1), got.k, got.v, slots, got.k_scale, got.v_scale)
    bad = differing(got, want)
    if bad:
        raise AssertionError(f"{bad} cache bytes differ from the reference's")
    return "the reference's bits"


def tiny_llama(folder: Path) -> Path:
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                         max_position_embeddings=1024, initializer_range=0.2,
                         bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def check_engine(folder: Path, kv_cache_dtype: str) -> str:
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "triton"):
        llm = LLM(str(folder), device="cuda", dtype="float32", attention_backend=backend,
                  kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256, block_size=BLOCK_SIZE)
        tokens[backend] = [out.token_ids for out in llm.generate(prompts, params)]
        llm.engine.shutdown()
    if tokens["reference"] != tokens["triton"]:
        raise AssertionError(f"greedy tokens differ: {tokens}")
    return "Triton (graphs, fused) == reference, 3 x 48 greedy tokens"


def main() -> int:
    failures = []

    def run(name, fn, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            print(f"{name}: {fn(*args)}", flush=True)
        except Exception:
            failures.append(name)
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)

    for element in ELEMENTS:
        run(f"store {element}", check_store, element)
        for dtype in (torch.float32, torch.bfloat16):
            run(f"attention {element} {dtype}", check_kernels, element, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_llama(Path(tmp) / "llama")
        for name in ("int8", "fp8"):
            run(f"engine {name}", check_engine, folder, name)
    print("ALL OK" if not failures else f"FAILED: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
