"""Sweeps the prefill / extend kernel's tile and launch settings at serving shapes (GPU only).

Each configuration is captured in a CUDA graph and timed from a cold L2; the figure is the
attention's matmul rate it reaches (causal: a token's query meets only the keys up to it).
The shapes are a W2 prefill step (Qwen3-0.6B heads, whole prompts of 100-1,024 tokens, 8,192
tokens in all) and a W4 step (Llama-3.2-1B heads, 128-token questions after a 2,048-token
cached prefix); the default settings are marked.

    python -m tools.kernels.tune_extend
"""

import itertools
import random

import torch

from tools.kernels.bench_attention import graphed, median_ms
from tools.kernels.tune_decode import paged_cache
from workers.attention.triton_prefill import extend_attention

STEP_TOKENS = 8192
SHAPES = {  # name: (query heads, kv heads, head_dim, [(cached, new) tokens per sequence])
    "qwen3-0.6b W2 prefill": (16, 8, 128, "prompts"),
    "llama-3.2-1b W4 prefix hit": (32, 8, 64, [(2048, 128)] * (STEP_TOKENS // 128)),
}
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)
DEFAULT = (64, 64, 4, 2)


def w2_prompts() -> list[tuple[int, int]]:
    """Whole prompts of W2's lengths (uniform 100-1,024) until a step's 8,192 tokens."""
    rng, seqs, total = random.Random(0), [], 0
    while True:
        n = rng.randint(100, 1024)
        if total + n > STEP_TOKENS:
            return seqs
        seqs.append((0, n))
        total += n


def make_inputs(heads: int, kv_heads: int, head_dim: int, seqs: list[tuple[int, int]]):
    """(extend_attention's arguments, max_query_len, causal matmul FLOPs)."""
    seq_lens = [cached + new for cached, new in seqs]
    k, v, table = paged_cache(seq_lens, kv_heads, head_dim)
    num_tokens = sum(new for _, new in seqs)
    q = torch.randn((num_tokens, heads, head_dim), device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0] + list(itertools.accumulate(new for _, new in seqs)))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    # each new token's query meets cached + its own index + 1 keys: QK^T and PV, 2 FLOPs a MAC
    keys_seen = sum(new * cached + new * (new + 1) // 2 for cached, new in seqs)
    flops = 4 * heads * head_dim * keys_seen
    args = (q, k, v, starts.int().cuda(), lens.cuda(), table)
    return args, max(new for _, new in seqs), flops


def time_config(args: tuple, max_query_len: int, config: tuple) -> float:
    block_m, block_n, warps, stages = config
    out = torch.empty_like(args[0])

    def run() -> None:
        extend_attention(*args, max_query_len, args[0].shape[-1] ** -0.5, out=out,
                         block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)

    return median_ms(graphed(run).replay)


def main() -> None:
    for name, (heads, kv_heads, head_dim, seqs) in SHAPES.items():
        seqs = w2_prompts() if seqs == "prompts" else seqs
        args, max_query_len, flops = make_inputs(heads, kv_heads, head_dim, seqs)
        print(f"\n{name}: {len(seqs)} sequences, {args[0].shape[0]} new tokens, "
              f"{flops / 1e12:.2f} TFLOP")
        results = []
        for config in itertools.product(BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES):
            try:
                results.append((time_config(args, max_query_len, config), config))
            except Exception as exc:  # noqa: BLE001 — e.g. out of shared memory: skip it
                print(f"  {config}: {type(exc).__name__}")
        results.sort()
        for ms, config in results[:6] + [r for r in results if r[1] == DEFAULT]:
            mark = "  <- default" if config == DEFAULT else ""
            block_m, block_n, warps, stages = config
            print(f"  block_m {block_m:3} block_n {block_n:3} warps {warps} stages {stages}: "
                  f"{ms * 1e3:8.1f} us {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s{mark}")


if __name__ == "__main__":
    main()
