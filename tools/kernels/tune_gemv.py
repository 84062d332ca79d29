"""The one-row projections of a decode step at real shapes (GPU only): cuBLAS plus the separate
norm / SiLU kernels, as the layers ran before, against the fused matrix-vector kernel
(workers/layers/gemv.py) over a sweep of its tile and launch settings.

Each variant runs once per layer of the model, on that layer's own weight, all captured in one
CUDA graph (so kernel gaps count as in a real step), timed from a cold L2. Also checks that the
fused kernel's output agrees with the unfused path.

    python -m tools.kernels.tune_gemv [--quick]
"""

import argparse
import itertools

import torch
import torch.nn.functional as F

from tools.kernels.bench_attention import median_ms
from workers.layers.fused_kernels import add_rms_norm, silu_and_mul
from workers.layers.gemv import default_config, gemv

# model: (layers, hidden, [(projection, output rows, input size, kind)]) with kind one of
# "plain", "norm" (residual add + RMSNorm before), "norm+silu" (and SiLU * up after)
MODELS = {
    "llama-3.2-1b": (16, [("qkv", 3072, 2048, "norm"), ("o", 2048, 2048, "plain"),
                          ("gate_up", 16384, 2048, "norm+silu"), ("down", 2048, 8192, "plain")]),
    "qwen3-0.6b": (28, [("qkv", 4096, 1024, "norm"), ("o", 1024, 2048, "plain"),
                        ("gate_up", 6144, 1024, "norm+silu"), ("down", 1024, 3072, "plain")]),
    "llama-3.1-8b tp2": (32, [("qkv", 3072, 4096, "norm"), ("o", 4096, 2048, "plain"),
                              ("gate_up", 14336, 4096, "norm+silu"),
                              ("down", 4096, 7168, "plain")]),
}
SWEEP = dict(block_n=(4, 8, 16), block_k=(256, 512, 1024), warps=(4, 8), stages=(2, 3, 4))
QUICK = dict(block_n=(4, 8, 16), block_k=(512, 1024), warps=(4, 8), stages=(3, 4))


def make_layers(layers: int, rows: int, k: int, kind: str) -> list[dict]:
    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    return [dict(weight=randn(rows, k) * k**-0.5, x=randn(1, k), residual=randn(1, k),
                 norm=1 + 0.1 * randn(k)) for _ in range(layers)]


def unfused(layer: dict, kind: str) -> torch.Tensor:
    x = layer["x"]
    if kind != "plain":
        x, _ = add_rms_norm(x, layer["residual"], layer["norm"], 1e-5)
    out = F.linear(x, layer["weight"])
    return silu_and_mul(out) if kind == "norm+silu" else out


def fused(layer: dict, kind: str, config) -> torch.Tensor:
    if kind == "plain":
        return gemv(layer["x"], layer["weight"], config=config)[0]
    return gemv(layer["x"], layer["weight"], residual=layer["residual"], norm_weight=layer["norm"],
                eps=1e-5, silu_mul=kind == "norm+silu", config=config)[0]


def graph_ms(fn, layers: list[dict]) -> float:
    """One call of fn per layer, captured as one graph: µs per call."""
    for layer in layers:
        fn(layer)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in layers:
            fn(layer)
    return median_ms(graph.replay) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configurations, not the sweep")
    args = parser.parse_args()
    sweep = QUICK if args.quick else SWEEP
    configs = list(itertools.product(*sweep.values()))
    for model, (num_layers, projections) in MODELS.items():
        print(f"\n{model}: {num_layers} layers, one token")
        total_before = total_after = 0.0
        for name, rows, k, kind in projections:
            layers = make_layers(num_layers, rows, k, kind)
            mbytes = rows * k * 2 / 1e6
            before = graph_ms(lambda layer, kind=kind: unfused(layer, kind), layers)
            expected, got = unfused(layers[0], kind).float(), fused(layers[0], kind, None).float()
            error = ((got - expected).abs().max() / expected.abs().max()).item()
            results = []
            for config in configs:
                try:
                    ms = graph_ms(lambda layer, c=config, kind=kind: fused(layer, kind, c), layers)
                    results.append((ms, config))
                except Exception as exc:  # noqa: BLE001 — e.g. out of resources: skip it
                    print(f"  {name} {config}: {type(exc).__name__}")
            results.sort()
            silu = kind == "norm+silu"
            default = default_config(rows // 2 if silu else rows, k, silu)
            default_ms = next((ms for ms, c in results if c == default), None)
            if default_ms is None:
                default_ms = graph_ms(lambda layer, kind=kind: fused(layer, kind, None), layers)
            total_before, total_after = total_before + before, total_after + default_ms
            print(f"  {name} ({kind}, {rows}x{k}, {mbytes:.1f} MB): cuBLAS + separate kernels "
                  f"{before * 1e3:.1f} us ({mbytes / before / 1e3:.2f} TB/s); fused default "
                  f"{default} {default_ms * 1e3:.1f} us ({mbytes / default_ms / 1e3:.2f} TB/s); "
                  f"max error / max |out| {error:.1e}")
            for ms, config in results[:4]:
                print(f"    {config}: {ms * 1e3:.1f} us ({mbytes / ms / 1e3:.2f} TB/s)")
        print(f"  a layer's projections: {total_before * 1e3:.1f} us before, "
              f"{total_after * 1e3:.1f} us fused (default configs)")


if __name__ == "__main__":
    main()
