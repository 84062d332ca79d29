"""The one-row projections of a decode step at real shapes (GPU only): cuBLAS plus the separate
norm / SiLU kernels, as the layers ran before, against the fused matrix-vector kernel
(workers/layers/gemv.py) over a sweep of its tile and launch settings.

Each variant runs once per layer of the model, on that layer's own weight, all captured in one
CUDA graph (so kernel gaps count as in a real step), timed from a cold L2. Also checks that the
fused kernel's output agrees with the unfused path.

    python -m workers.layers.tune_gemv [--quick]
    python -m workers.layers.tune_gemv --mlp    (each model's MLP: gemv's two launches against
        the one persistent launch of workers/layers/persistent_mlp.py, over a few tilings)
    python -m workers.layers.tune_gemv --weights-first    (the projections with a norm before
        them, with and without their first weight chunk requested before the norm's pass)
"""

import argparse
import itertools

import torch
import torch.nn.functional as F

from workers.attention.bench_attention import median_ms
from workers.layers.fused_kernels import add_rms_norm, silu_and_mul
from workers.layers.gemv import default_config, gemv
from workers.layers.persistent_mlp import barrier_missed, new_barrier, persistent_mlp

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
SWEEP = dict(block_n=(4, 8, 16, 32), block_k=(256, 512, 1024), warps=(4, 8), stages=(2, 3, 4))
QUICK = dict(block_n=(4, 8), block_k=(1024,), warps=(4, 8), stages=(3,))


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


def fused(layer: dict, kind: str, config, weights_first: bool | None = None) -> torch.Tensor:
    if kind == "plain":
        return gemv(layer["x"], layer["weight"], config=config)[0]
    return gemv(layer["x"], layer["weight"], residual=layer["residual"], norm_weight=layer["norm"],
                eps=1e-5, silu_mul=kind == "norm+silu", config=config,
                weights_first=weights_first)[0]


def graph_ms(fn, layers: list[dict]) -> float:
    """One call of fn per layer, captured as one graph: µs per call."""
    for layer in layers:
        fn(layer)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in layers:
            fn(layer)
    return median_ms(graph.replay) / len(layers)


# (BLOCK_N_UP, BLOCK_K_UP, BLOCK_N_DOWN, BLOCK_K_DOWN, num_warps) of the persistent MLP
MLP_CONFIGS = [(4, 1024, 8, 1024, 8), (8, 512, 8, 1024, 8), (16, 512, 16, 512, 8),
               (4, 1024, 4, 2048, 8), (8, 1024, 16, 1024, 16)]


def mlp_comparison(model: str) -> None:
    """A model's MLPs, one a layer, in one graph: gemv's gate_up + down against the persistent
    launch; µs a layer from a cold L2, and the largest difference from the two launches."""
    num_layers, projections = MODELS[model]
    (_, gate_up_rows, hidden, _), (_, _, inter, _) = projections[2], projections[3]
    layers = [dict(gate_up=w["weight"], x=w["x"], residual=w["residual"], norm=w["norm"])
              for w in make_layers(num_layers, gate_up_rows, hidden, "norm+silu")]
    for layer, down in zip(layers, make_layers(num_layers, hidden, inter, "plain"), strict=True):
        layer["down"] = down["weight"]
    barrier = new_barrier(torch.device("cuda"))

    def two_launches(layer: dict) -> torch.Tensor:
        act, _ = gemv(layer["x"], layer["gate_up"], residual=layer["residual"],
                      norm_weight=layer["norm"], eps=1e-5, silu_mul=True)
        return gemv(act, layer["down"])[0]

    def one_launch(layer: dict, config) -> torch.Tensor:
        return persistent_mlp(layer["x"], layer["gate_up"], layer["down"], layer["residual"],
                              layer["norm"], 1e-5, barrier, config=config)[0]

    mbytes = (gate_up_rows * hidden + hidden * inter) * 2 / 1e6
    base = graph_ms(two_launches, layers)
    print(f"\n{model}: MLP {mbytes:.1f} MB a layer; two launches {base * 1e3:.1f} us "
          f"({mbytes / base / 1e3:.2f} TB/s)")
    expected = two_launches(layers[0]).float()
    for config in MLP_CONFIGS:
        try:
            ms = graph_ms(lambda layer, c=config: one_launch(layer, c), layers)
        except Exception as exc:  # noqa: BLE001 — e.g. out of resources: say so, go on
            print(f"  persistent {config}: {type(exc).__name__}: {exc}"[:200])
            continue
        error = (one_launch(layers[0], config).float() - expected).abs().max().item()
        print(f"  persistent {config}: {ms * 1e3:.1f} us ({mbytes / ms / 1e3:.2f} TB/s), "
              f"max |difference| {error:.1e}, barrier missed: {barrier_missed(barrier)}")


def weights_first_comparison(model: str) -> None:
    """Each projection with a norm before it, default tiles, weights first or not: µs a call."""
    num_layers, projections = MODELS[model]
    print(f"\n{model}: projections with a norm, µs a call (one graph of {num_layers} layers)")
    for name, rows, k, kind in projections:
        if kind == "plain":
            continue
        layers = make_layers(num_layers, rows, k, kind)
        times = [graph_ms(lambda layer, first=first, kind=kind: fused(layer, kind, None, first),
                          layers)
                 for first in (False, True)]
        same = torch.equal(fused(layers[0], kind, None, False), fused(layers[0], kind, None, True))
        print(f"  {name} ({rows}x{k}): norm's pass first {times[0] * 1e3:.1f} us, weights first "
              f"{times[1] * 1e3:.1f} us, same output: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configurations, not the sweep")
    parser.add_argument("--mlp", action="store_true", help="the persistent MLP against gemv")
    parser.add_argument("--weights-first", action="store_true",
                        help="the norm's projections with their first weights requested first")
    args = parser.parse_args()
    if args.weights_first:
        for model in MODELS:
            weights_first_comparison(model)
        return
    if args.mlp:
        for model in MODELS:
            mlp_comparison(model)
        return
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
