"""Times decode (and prefill) attention over bf16, int8 and e4m3 caches at the Llama-3.1-8B
shape (32 query heads, 8 kv heads, head_dim 128, blocks of 16) on a GPU, each variant of the
quantized read side by side, and checks every output against the reference backend.

Variants: ``cast`` (Triton's own int8/e4m3 -> float16 conversion) against ``asm`` (the
packed PTX of workers/attention/triton_quant.py), and the decode tiles for one-byte elements.
Each kernel runs in a CUDA graph from a cold L2 (tools/kernels/bench_attention.py); the
figure is its KV read bandwidth (elements and scales). Split counts are the engine's for
W6's 4,608-token sequences. Kernels compile first in parallel processes (Triton's disk cache).

    python -m tools.kernels.time_kv_decode [--json PATH]
"""

import argparse
import json
import multiprocessing
import random

import torch

from tools.kernels.bench_attention import graphed, median_ms
from workers.attention.kv_quant import quantize
from workers.attention.metadata import longest_first
from workers.attention.reference import paged_attention
from workers.attention.triton_backend import num_sms
from workers.attention.triton_decode import choose_num_splits, decode_attention, default_tile
from workers.attention.triton_prefill import extend_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_MODEL_LEN = 32, 8, 128, 16, 4608
FORMATS = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
DECODE_CASES = {  # name: (batch, shortest, longest context)
    "batch 1, 4096": (1, 4096, 4096),
    "batch 32, 4096": (32, 4096, 4096),
    "batch 128, 1024-4608": (128, 1024, 4608),
    "batch 360, 4352 (W6 int8)": (360, 4352, 4352),
}
ONE_SPLIT_TILES = ((64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 4, 2))
SPLIT_TILES = ((64, 4, 3), (128, 4, 3))
TOLERANCE = 2e-2  # bf16 outputs near 1; the reference rounds its dequantized rows to bf16


def variants(fmt: str, splits: int) -> list[tuple[str, tuple[int, int, int]]]:
    """(convert, tile) pairs to time: bf16 as the engine runs it; quantized: both conversions
    at the default tile, then the other tiles with asm."""
    default = default_tile(splits, HEAD_DIM, FORMATS[fmt].itemsize)
    if fmt == "bf16":
        return [("cast", default)]
    tiles = ONE_SPLIT_TILES if splits == 1 else SPLIT_TILES
    return [("cast", default), ("asm", default)] + [("asm", t) for t in tiles if t != default]


def make_case(batch: int, lo: int, hi: int, fmt: str, seed: int = 0):
    """q, the cache (k, v, k_scale, v_scale), block table, seq_lens, order: random bf16 K/V,
    quantized to ``fmt``, each sequence's blocks scattered over the cache."""
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(sum(blocks), device="cuda", generator=gen).int()
    table = torch.zeros((batch, max(blocks)), dtype=torch.int32, device="cuda")
    taken = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[taken:taken + n]
        taken += n
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    cache = (k, v, None, None)
    if fmt != "bf16":
        (kq, ks), (vq, vs) = quantize(k, FORMATS[fmt]), quantize(v, FORMATS[fmt])
        cache = (kq, vq, ks, vs)
    q = torch.randn((batch, HEADS, HEAD_DIM), device="cuda", generator=gen,
                    dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    order = torch.from_numpy(longest_first(seq_lens.cpu().numpy())).cuda() if batch > 1 else None
    bytes_read = 2 * sum(lens) * KV_HEADS * (HEAD_DIM * FORMATS[fmt].itemsize
                                            + (2 if fmt != "bf16" else 0))
    return q, cache, table, seq_lens, order, bytes_read


def run_decode(case, splits: int, convert: str, tile, out=None) -> torch.Tensor:
    q, (k, v, ks, vs), table, seq_lens, order, _ = case
    return decode_attention(q, k, v, table, seq_lens, HEAD_DIM**-0.5, splits, out=out,
                            tile=tile, order=order, k_scale=ks, v_scale=vs, convert=convert)


def reference(case) -> torch.Tensor:
    """The reference backend's attention (PyTorch, rows dequantized to bf16) in float32."""
    from workers.attention.metadata import AttentionMetadata

    q, (k, v, ks, vs), table, seq_lens, _, _ = case
    lens = seq_lens.tolist()
    meta = AttentionMetadata(torch.zeros(0), torch.arange(len(lens) + 1, device="cuda").int(),
                             seq_lens, table, 1, max(lens), [1] * len(lens), lens)
    return paged_attention(q, k, v, meta, HEAD_DIM**-0.5, ks, vs).float()


def warm(job: tuple) -> str:
    """Compiles one variant (in a worker process) on a small case of the same kernel key."""
    fmt, splits, convert, tile, batch = job
    try:
        case = make_case(batch, 64, 300, fmt)
        run_decode(case, splits, convert, tile)
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - reported, the variant is skipped later
        return f"{job}: {type(error).__name__}: {error}"


def warm_extend(job: tuple) -> str:
    fmt, convert = job
    try:
        time_extend(fmt, convert, lens=(200, 100), timed=False)
        return ""
    except Exception as error:  # noqa: BLE001
        return f"extend {job}: {type(error).__name__}: {error}"


def time_extend(fmt: str, convert: str, lens=(4096, 4096), timed=True) -> tuple[float, float]:
    """W6's prefill chunk: two whole 4,096-token prompts. (ms, max |diff| against the
    reference); the diff only when timed."""
    from workers.attention.metadata import AttentionMetadata

    batch = len(lens)
    case = make_case(batch, lens[0], lens[0], fmt) if len(set(lens)) == 1 else make_case(
        batch, min(lens), max(lens), fmt)
    _, (k, v, ks, vs), table, seq_lens, _, _ = case
    real = seq_lens.tolist()
    q = torch.randn((sum(real), HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")

    def run() -> torch.Tensor:
        return extend_attention(q, k, v, starts, seq_lens, table, max(real), HEAD_DIM**-0.5,
                                k_scale=ks, v_scale=vs, convert=convert)

    got = run()
    if not timed:
        torch.cuda.synchronize()
        return 0.0, 0.0
    meta = AttentionMetadata(torch.zeros(0), starts, seq_lens, table, max(real), max(real),
                             real, real)
    want = paged_attention(q, k, v, meta, HEAD_DIM**-0.5, ks, vs).float()
    return median_ms(run), (got.float() - want).abs().max().item()


def time_decode_case(name: str, batch: int, lo: int, hi: int, splits: int) -> list[dict]:
    """Every format's variants at one case, bf16 first (the ratios' base)."""
    results, base_ms = [], None
    for fmt in FORMATS:
        case = make_case(batch, lo, hi, fmt)
        want = reference(case) if batch <= 128 else None
        for convert, tile in variants(fmt, splits):
            out = torch.empty_like(case[0])

            def run(c=case, cv=convert, t=tile, o=out) -> torch.Tensor:
                return run_decode(c, splits, cv, t, o)

            try:
                run()
                diff = (out.float() - want).abs().max().item() if want is not None else None
                ms = median_ms(graphed(run).replay)
            except Exception as error:  # noqa: BLE001 - e.g. a compile failure
                print(f"  {fmt:5} {convert:4} {tile}: {type(error).__name__}: {error}")
                continue
            base_ms = ms if fmt == "bf16" else base_ms
            tbs = case[5] / (ms * 1e-3) / 1e12
            ok = "" if diff is None else ("ok" if diff <= TOLERANCE else "BAD")
            print(f"  {fmt:5} {convert:4} tile {tile}: {ms * 1e3:8.1f} us {tbs:5.2f} TB/s"
                  f"  x bf16 {ms / base_ms:5.2f}  max|diff| "
                  f"{'-' if diff is None else f'{diff:.1e}'} {ok}", flush=True)
            results.append({"case": name, "splits": splits, "format": fmt, "convert": convert,
                            "tile": tile, "us": ms * 1e3, "tb_s": tbs, "max_diff": diff})
        del case
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--workers", type=int, default=8, help="compiling processes")
    args = parser.parse_args()
    sms = num_sms(torch.device("cuda"))
    plan = {name: choose_num_splits(b, KV_HEADS, MAX_MODEL_LEN, sms)
            for name, (b, _, _) in DECODE_CASES.items()}
    # one row runs unordered, more rows ordered: another kernel each, compiled alike
    jobs = sorted({(fmt, plan[name], convert, tile, min(batch, 4))
                   for name, (batch, _, _) in DECODE_CASES.items() for fmt in FORMATS
                   for convert, tile in variants(fmt, plan[name])})
    ext_jobs = [(fmt, c) for fmt in FORMATS for c in (("cast",) if fmt == "bf16" else
                                                       ("cast", "asm"))]
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        errors = [e for e in pool.map(warm, jobs) + pool.map(warm_extend, ext_jobs) if e]
    for error in errors:
        print("compile failed:", error)
    print(torch.cuda.get_device_name(), f"{len(jobs)} decode variants compiled", flush=True)

    results = []
    for name, (batch, lo, hi) in DECODE_CASES.items():
        print(f"\ndecode {name}: {plan[name]} split(s)")
        results += time_decode_case(name, batch, lo, hi, plan[name])
    print("\nextend, two 4,096-token prompts (W6's prefill chunk)")
    for fmt, convert in ext_jobs:
        ms, diff = time_extend(fmt, convert)
        print(f"  {fmt:5} {convert:4}: {ms * 1e3:8.1f} us  max|diff| {diff:.1e}"
              f" {'ok' if diff <= TOLERANCE else 'BAD'}", flush=True)
        results.append({"case": "extend 2 x 4096", "format": fmt, "convert": convert,
                        "us": ms * 1e3, "max_diff": diff})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"errors": errors, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
