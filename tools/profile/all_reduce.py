"""All-reduce latency inside a CUDA graph: NCCL against the two peer-memory kernels (PyTorch's
one-shot, tandem's push; workers/layers/symmetric_all_reduce.py).

Two (or more) processes, one GPU each, sum decode-sized tensors (rows x hidden, bf16) many times
inside one captured graph, as a tensor-parallel decode step does; the figure is µs per sum.
Every process sees every GPU and runs on cuda:rank, as the shard actors do (PyTorch's peer-memory
rendezvous refuses two ranks on the same device index). Each size's peer-memory sum is checked
equal to NCCL's.

    python -m tools.profile.all_reduce --world-size 2 --rows 1 8 64 256 --hidden 4096
"""

import argparse
import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cluster import environment
from workers.layers.symmetric_all_reduce import KERNELS, SymmetricAllReduce

SUMS_PER_GRAPH = 64  # about one decode step of an 8B model at TP 2 (65 sums)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def graph_us_per_call(fn, x: torch.Tensor, replays: int) -> float:
    """µs per fn(x) when SUMS_PER_GRAPH of them replay back to back from one graph."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(SUMS_PER_GRAPH):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * SUMS_PER_GRAPH)


def run_rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    environment.prepare_shard_process(on_gpu=True, tensor_parallel=True, replica_gpus=None)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world_size, device_id=device)
    group = dist.group.WORLD
    reducers = {kernel: SymmetricAllReduce(group, device, kernel=kernel) for kernel in KERNELS}
    rows_out = []
    for rows in args.rows:
        g = torch.Generator(device=device).manual_seed(rows * 100 + rank)
        x = torch.randn(rows, args.hidden, device=device, dtype=torch.bfloat16, generator=g)
        nccl_sum = x.clone()
        dist.all_reduce(nccl_sum, group=group)
        row = {"rows": rows, "bytes": x.numel() * x.element_size(),
               "nccl_us": graph_us_per_call(lambda t: dist.all_reduce(t, group=group),
                                            x.clone(), args.replays)}
        for kernel, reducer in reducers.items():
            first = reducer(x)
            row[f"{kernel}_us"] = graph_us_per_call(reducer, x, args.replays)
            # equal on the first sum and after every replay (slots and flags reused)
            row[f"{kernel}_equal"] = bool(torch.equal(first, nccl_sum)
                                          and torch.equal(reducer(x), nccl_sum))
            row[f"{kernel}_peer_missed"] = reducer.peer_missed()
        row["equal"] = all(row[f"{kernel}_equal"] for kernel in KERNELS)
        rows_out.append(row)
    if rank == 0:
        queue.put(rows_out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--output", help="a JSON file for the figures")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(run_rank, args=(args, free_port(), queue), nprocs=args.world_size,
                       start_method="spawn")
    rows = queue.get()
    print("| rows | bytes | NCCL µs | one-shot µs | push µs | push vs NCCL | equal to NCCL |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['bytes']} | {r['nccl_us']:.1f} | {r['one_shot_us']:.1f} | "
              f"{r['push_us']:.1f} | {r['nccl_us'] / r['push_us']:.2f}x | {r['equal']} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"world_size": args.world_size, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
