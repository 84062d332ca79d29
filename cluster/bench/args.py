"""`tandem bench {latency,throughput,prefix,serve,speculative,tp-scaling,kv-accuracy,
capacity,structured}`: the arguments; the work of the first three is in commands.py, serve's in
serve_bench.py (its load in serve_load.py), speculative's in speculative.py, tp-scaling's in
tp_scaling.py, kv-accuracy's in kv_accuracy.py, capacity's in capacity.py, structured's in
structured.py."""

import argparse
import sys

from cluster.bench.capacity import add_capacity_parser
from cluster.bench.serve_bench import add_serve_bench_parser
from cluster.bench.shapes import SHAPES
from cluster.bench.speculative import add_speculative_parser
from cluster.bench.structured import add_structured_parser


def common_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--shape", choices=sorted(SHAPES),
                       help="a real architecture with random weights (built once, cached)")
    model.add_argument("--model", default="smollm2-135m-instruct",
                       help="catalog name or HF folder (default: %(default)s)")
    parser.add_argument("--model-cache", help="where --shape folders go "
                        "(default: <tandem cache>/bench-models)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                            "float16"])
    parser.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if present)")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "reference", "triton"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--decode-steps", type=int, default=0,
                        help="decode steps per host round trip (0: auto, 8 on a GPU)")
    parser.add_argument("--decode-lookahead", action=argparse.BooleanOptionalAction, default=True,
                        help="multi-step calls also run the next call's first step (default: on)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="schedule each step while the workers run the one before "
                        "(default: on a GPU, off on the CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                        help="how the KV cache stores K and V (default: as --dtype)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output",
                        help="JSON path (default: bench-results/<workload>-<time>.json)")


# handlers import the heavy modules only when a benchmark really runs
def run_latency(args: argparse.Namespace) -> int:
    from cluster.bench.commands import latency

    return latency(args)


def run_throughput(args: argparse.Namespace) -> int:
    from cluster.bench.commands import throughput

    return throughput(args)


def run_prefix(args: argparse.Namespace) -> int:
    from cluster.bench.commands import prefix

    return prefix(args)


def tensor_parallel_size(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 8:
        raise argparse.ArgumentTypeError(f"{value}: shards of one replica share a node, 1 to 8")
    return value


def tp_scaling_problem(args: argparse.Namespace) -> str | None:
    """Why --tp cannot split --shape, before anything is built (a --model folder's engine
    says so itself, as it starts)."""
    if args.model is not None:
        return None
    from types import SimpleNamespace

    from workers.models.llama import tensor_parallel_sizes

    shape = SimpleNamespace(**SHAPES[args.shape])
    wrong = [tp for tp in args.tp if tp not in tensor_parallel_sizes(shape)]
    if not wrong:
        return None
    return (f"--tp {' '.join(map(str, wrong))}: does not split {args.shape} "
            f"({shape.num_attention_heads} attention heads over {shape.num_key_value_heads} kv "
            f"heads); choose from {', '.join(map(str, tensor_parallel_sizes(shape)))}")


def run_tp_scaling(args: argparse.Namespace) -> int:
    problem = tp_scaling_problem(args)
    if problem is not None:
        print(f"tandem bench tp-scaling: error: {problem}", file=sys.stderr)
        return 2
    from cluster.bench.tp_scaling import tp_scaling

    return tp_scaling(args)


def add_tp_scaling_parser(workloads: argparse._SubParsersAction) -> None:
    parser = workloads.add_parser("tp-scaling", help="W7: TPOT and tokens/s at TP 1 vs N")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES),
                        help="a real architecture with random bf16 weights (default: "
                        "%(default)s; llama-3-70b at --tp 4 8)")
    parser.add_argument("--model", help="a model folder instead of a random --shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tp", type=tensor_parallel_size, nargs="+", default=[1, 2],
                        help="tensor-parallel sizes, run in turn; the first is the base of "
                        "speedup and scaling efficiency (default: 1 2)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64],
                        help="requests at once, each run in turn (100 with --output-len 256: "
                        "the brief's 100 concurrent requests)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--model-root", default="/tmp/tandem-shapes")
    parser.add_argument("--with-uni", action="store_true", help="also TP=1 in-process")
    parser.add_argument("--profile", action="store_true",
                        help="print every rank's torch.profiler table of a batch-1 request")
    parser.add_argument("--all-reduce", choices=["symmetric", "nccl", "both"], default="both",
                        help="TP > 1: small sums through peer memory, NCCL only, or both runs")
    parser.add_argument("--decode-lookahead", action=argparse.BooleanOptionalAction, default=True,
                        help="multi-step calls also run the next call's first step")
    parser.add_argument("--output", default="bench-results/w7.json")
    parser.set_defaults(handler=run_tp_scaling)


def run_kv_accuracy(args: argparse.Namespace) -> int:
    from cluster.bench.kv_accuracy import kv_accuracy

    return kv_accuracy(args)


def add_kv_accuracy_parser(workloads: argparse._SubParsersAction) -> None:
    parser = workloads.add_parser("kv-accuracy", help="quantized vs unquantized KV cache: "
                                  "top-1 agreement and perplexity under teacher forcing")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="catalog name or HF folder (default: %(default)s)")
    parser.add_argument("--kv-cache-dtype", dest="formats", nargs="+", choices=["int8", "fp8"],
                        default=["int8", "fp8"], help="the quantized formats (default: both)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                            "float16"],
                        help="the model's and the reference cache's (auto: float32 on the CPU)")
    parser.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if present)")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "reference", "triton"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens-per-text", type=int, default=1024)
    parser.add_argument("--chat-prompts", type=int, default=8,
                        help="greedy chat answers compared, of 8 fixed questions (0: none)")
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--chat-kv-blocks", type=int, default=256,
                        help="KV blocks of the engines that answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output",
                        help="JSON path (default: bench-results/kv-accuracy-<time>.json)")
    parser.set_defaults(handler=run_kv_accuracy)


def add_bench_parsers(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks against HF and the roofline")
    workloads = bench.add_subparsers(dest="workload", required=True)

    latency = workloads.add_parser("latency", help="W1: batch-1 TTFT and TPOT")
    common_arguments(latency)
    latency.add_argument("--prompt-len", type=int, default=128)
    latency.add_argument("--output-len", type=int, default=512)
    latency.add_argument("--repeats", type=int, default=3)
    latency.add_argument("--hf-output-len", type=int, default=64,
                         help="output tokens of the HF batch-1 run (TPOT from it)")
    latency.add_argument("--compare-backends", action="store_true",
                         help="also check Triton == reference greedy tokens in float32")
    latency.add_argument("--profile", action="store_true",
                         help="on a GPU: time the batch-1 graph alone and profile 32 steps")
    latency.set_defaults(handler=run_latency)

    throughput = workloads.add_parser("throughput", help="W2: nano-vllm's offline workload")
    common_arguments(throughput)
    throughput.add_argument("--num-requests", type=int, default=256)
    throughput.add_argument("--min-len", type=int, default=100)
    throughput.add_argument("--max-len", type=int, default=1024)
    throughput.add_argument("--hf-batch-sizes", default="16,64,256",
                            help="generate() batch sizes tried, on the first B requests")
    throughput.add_argument("--hf-max-new-tokens", type=int, default=0,
                            help="cap on HF output tokens per request (useful tok/s counted); "
                                 "0: each request's own length, the same work as tandem's")
    throughput.add_argument("--hf-batch-requests", type=int, default=64,
                            help="requests for generate_batch() (0: skip it)")
    throughput.set_defaults(handler=run_throughput)

    prefix = workloads.add_parser("prefix", help="W4: shared prefixes, cache on vs off")
    common_arguments(prefix)
    prefix.add_argument("--num-groups", type=int, default=64)
    prefix.add_argument("--group-size", type=int, default=16)
    prefix.add_argument("--prefix-len", type=int, default=2048)
    prefix.add_argument("--question-len", type=int, default=128)
    prefix.add_argument("--output-len", type=int, default=256)
    prefix.add_argument("--replicas", type=int, default=1,
                        help="engine replicas on Ray (> 1: each --routing policy in turn)")
    prefix.add_argument("--routing", default="prefix-affinity,least-loaded,round-robin",
                        help="with --replicas > 1: the policies to run, comma-separated")
    prefix.add_argument("--request-rate", type=float, default=0.0,
                        help="Poisson arrivals at this many requests a second (seeded; 0: "
                        "all at once)")
    prefix.add_argument("--skewed", action="store_true",
                        help="half of the requests share one hot prefix")
    prefix.add_argument("--interleaved", action="store_true",
                        help="the groups' requests in a shuffled (seeded) order, not one group "
                        "after another")
    prefix.add_argument("--pass-major", action="store_true",
                        help="every group's first request, then every group's second, ...: "
                        "a prefix comes back after all the others (W4-large)")
    prefix.add_argument("--num-kv-blocks", type=int,
                        help="KV blocks of each replica (default: as many as memory allows); "
                        "fewer than all prefixes need makes the cache's capacity count")
    prefix.add_argument("--host-kv-cache-gb", type=float, default=0.0,
                        help="> 0: compare KV tiers instead of cache on / off: recompute (the "
                        "device cache alone), this host tier, and with --disk-kv-cache-dir a "
                        "quarter of it over that disk tier (cluster/bench/prefix_tiers.py)")
    prefix.add_argument("--host-loads-in-place", action="store_true",
                        help="with --host-kv-cache-gb: a run more, its host tier's loads read "
                        "the pinned slots in place, layer by layer (engine option "
                        "`host_loads_in_place`)")
    prefix.add_argument("--disk-kv-cache-dir", help="the disk tier's directory (host + disk run)")
    prefix.add_argument("--disk-kv-cache-gb", type=float, default=10.0)
    prefix.set_defaults(handler=run_prefix)

    add_serve_bench_parser(workloads)  # W3: cluster/bench/serve_bench.py (serving owns it)
    add_speculative_parser(workloads, common_arguments)  # W5: cluster/bench/speculative.py
    add_tp_scaling_parser(workloads)  # W7: cluster/bench/tp_scaling.py
    add_kv_accuracy_parser(workloads)  # cluster/bench/kv_accuracy.py
    add_capacity_parser(workloads, common_arguments)  # W6: cluster/bench/capacity.py
    add_structured_parser(workloads, common_arguments)  # cluster/bench/structured.py
