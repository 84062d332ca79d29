"""Sweeps the decode kernel's tile and launch settings at serving shapes (GPU only).

Each configuration is captured in a CUDA graph and timed from a cold L2; the figure is the KV
read bandwidth it reaches. The rows run longest first, as the engine orders them. The shapes
are W2's (Qwen3-0.6B heads, a batch of mixed lengths) and W3's (Llama-3.2-1B heads, batch
64); the default settings are marked.

    python -m tools.kernels.tune_decode
"""

import itertools
import random

import torch

from tools.kernels.bench_attention import graphed, median_ms
from workers.attention.metadata import longest_first
from workers.attention.triton_backend import num_sms
from workers.attention.triton_decode import choose_num_splits, decode_attention, default_tile

BLOCK_SIZE = 16
SHAPES = {  # name: (query heads, kv heads, head_dim, batch, shortest, longest context)
    "qwen3-0.6b W2 mix": (16, 8, 128, 128, 200, 2000),
    "llama-3.2-1b batch 64": (32, 8, 64, 64, 900, 1300),
}
BLOCK_N, NUM_WARPS, NUM_STAGES = (32, 64, 128), (4, 8), (2, 3, 5, 6)
SPLITS = (1, 2, 4, 8)


def paged_cache(seq_lens: list[int], kv_heads: int, head_dim: int):
    """(k_cache, v_cache, block table on the GPU): random bf16 K/V, each sequence's blocks
    scattered over the cache in a random order."""
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    order = torch.randperm(sum(blocks))
    table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[taken:taken + n].int()
        taken += n
    cache = (sum(blocks), BLOCK_SIZE, kv_heads, head_dim)
    k = torch.randn(cache, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(cache, device="cuda", dtype=torch.bfloat16)
    return k, v, table.cuda()


def make_inputs(heads: int, kv_heads: int, head_dim: int, batch: int, lo: int, hi: int):
    rng = random.Random(0)
    seq_lens = [rng.randint(lo, hi) for _ in range(batch)]
    k, v, table = paged_cache(seq_lens, kv_heads, head_dim)
    q = torch.randn((batch, heads, head_dim), device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(seq_lens) * kv_heads * head_dim * 2
    return (q, k, v, table, lens, head_dim**-0.5), kv_bytes, max(seq_lens)


def time_config(args: tuple, splits: int, block_n: int, warps: int, stages: int) -> float:
    order = torch.from_numpy(longest_first(args[4].cpu().numpy())).cuda()

    def run() -> None:
        decode_attention(*args, splits, out=out, tile=(block_n, warps, stages), order=order)

    out = torch.empty_like(args[0])
    return median_ms(graphed(run).replay)


def main() -> None:
    sms = num_sms(torch.device("cuda"))
    for name, (heads, kv_heads, head_dim, batch, lo, hi) in SHAPES.items():
        args, kv_bytes, longest = make_inputs(heads, kv_heads, head_dim, batch, lo, hi)
        splits = choose_num_splits(batch, kv_heads, longest, sms)
        print(f"\n{name}: batch {batch}, contexts {lo}-{hi}, {kv_bytes / 1e9:.2f} GB of KV, "
              f"{splits} split(s) chosen")

        def report(ms: float, label: str, kv_bytes: int = kv_bytes) -> None:
            print(f"  {label}: {ms * 1e3:7.1f} us {kv_bytes / (ms * 1e-3) / 1e12:5.2f} TB/s")

        results = []
        for config in itertools.product(BLOCK_N, NUM_WARPS, NUM_STAGES):
            try:
                results.append((time_config(args, splits, *config), config))
            except Exception as exc:  # noqa: BLE001 — e.g. out of shared memory: skip it
                print(f"  {config}: {type(exc).__name__}")
        results.sort()
        default = default_tile(splits, head_dim)
        for ms, (block_n, warps, stages) in results[:6] + [r for r in results if r[1] == default]:
            mark = "  <- default" if (block_n, warps, stages) == default else ""
            report(ms, f"block_n {block_n:3} warps {warps} stages {stages}{mark}")
        # mixed lengths: more splits even balance long and short sequences' programs
        best = results[0][1]
        for count in SPLITS:
            report(time_config(args, count, *best), f"{count} split(s) at {best}")

if __name__ == "__main__":
    main()
