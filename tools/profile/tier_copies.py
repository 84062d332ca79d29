"""What the host tier's copies cost on a GPU: `python -m tools.profile.tier_copies`.

Two cache shapes (Qwen2.5-0.5B: 24 layers of (16, 2, 64) bfloat16 K and V, 192 KiB a block;
Llama-3.1-8B: 32 layers of (16, 8, 128), 2 MiB a block), 512 blocks in scattered host slots:
a plain pinned copy's rate each way, the staged stores' rate alone and beside a forward-sized
compute (two 4096² bfloat16 matmuls a layer), then for the staged loads and the in-place
kernel (workers/pinned_copies.py) at several program counts: the in-step loads' rate alone and
beside that compute (waiting at the layer gate as the model does).
"""

import argparse
import random
from collections.abc import Callable

import torch

from cluster.bench.roofline import median_seconds
from kvstore.transfers import BlockLoad, KVTransfers
from workers.attention.layer_cache import LayerKVCache
from workers.host_layout import layer_tensors
from workers.kv_offload import KVOffloader
from workers.layers.parallel import TensorParallelGroup

SHAPES = {"qwen2.5-0.5b": (24, (16, 2, 64)), "llama-3.1-8b": (32, (16, 8, 128))}


def milliseconds(fn: Callable[[], object]) -> float:
    """The median of five timed calls (after two untimed), in ms."""
    return median_seconds(fn, torch.device("cuda"), repeats=5) * 1e3


def step(offloader: KVOffloader, transfers: KVTransfers | None,
         forward: Callable[[], None] = lambda: None, after: KVTransfers | None = None) -> None:
    offloader.before_step(transfers, [], [])
    forward()
    offloader.after_step(after if after is not None else transfers)
    offloader.report(idle=False)


def profile(name: str, num_blocks: int, program_counts: list[int]) -> None:
    layers, shape = SHAPES[name]
    k, v = (torch.randn((layers, 2 * num_blocks + 8, *shape), device="cuda").bfloat16()
            for _ in range(2))
    tensors = layer_tensors([LayerKVCache(k[i], v[i]) for i in range(layers)])
    single = TensorParallelGroup.single()
    staged = KVOffloader(tensors, num_blocks, None, single, in_place=False)
    placed = KVOffloader(tensors, num_blocks, None, single,
                         model_layers=(layers, len(tensors)))
    if placed.pinned is None:
        raise SystemExit("the device does not read pinned host memory in place here")
    gigabytes = num_blocks * staged.layout.block_bytes / 1e9
    device = torch.empty(num_blocks * staged.layout.block_bytes, dtype=torch.uint8,
                         device="cuda")
    pinned = torch.empty_like(device, device="cpu").pin_memory()
    h2d = gigabytes / milliseconds(lambda: device.copy_(pinned, non_blocking=True)) * 1e3
    d2h = gigabytes / milliseconds(lambda: pinned.copy_(device, non_blocking=True)) * 1e3
    print(f"{name}: {num_blocks} blocks, {gigabytes:.3f} GB; plain pinned copies "
          f"H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    slots = random.Random(0).sample(range(num_blocks), num_blocks)
    blocks = list(range(1, 2 * num_blocks, 2))
    loads = KVTransfers(loads=[BlockLoad(f"r{i}", slots[i:i + 16], blocks[i:i + 16],
                                         in_step=True) for i in range(0, num_blocks, 16)])
    stores = KVTransfers(stores=list(zip(blocks, slots, strict=True)))
    matrix = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def forward(offloader: KVOffloader | None = None) -> None:
        for layer in range(layers):
            if offloader is not None:
                offloader.gate.before_layer(layer)
            for _ in range(2):
                matrix @ matrix

    store = gigabytes / milliseconds(lambda: step(staged, stores)) * 1e3
    stored = milliseconds(lambda: step(staged, None, forward, stores))
    print(f"  compute alone {milliseconds(forward):.2f} ms; staged stores {store:.1f} GB/s, "
          f"compute with them {stored:.2f} ms")
    for programs in [0, *program_counts]:
        offloader = staged if programs == 0 else placed
        if programs:
            assert placed.pinned is not None
            placed.pinned.programs = programs
        load = gigabytes / milliseconds(lambda o=offloader: step(o, loads)) * 1e3
        beside = milliseconds(lambda o=offloader: step(o, loads, lambda: forward(o),
                                                       KVTransfers()))
        label = "staged" if programs == 0 else f"{programs} programs"
        print(f"  {label:<13} loads {load:5.1f} GB/s; compute with the loads {beside:.2f} ms")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--programs", type=int, nargs="+", default=[16, 32, 64, 128])
    args = parser.parse_args()
    for name in args.shapes:
        profile(name, args.num_blocks, args.programs)


if __name__ == "__main__":
    main()
