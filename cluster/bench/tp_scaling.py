"""W7: tensor-parallel scaling on one node — TPOT and tokens/s at TP 1 vs N, batch 1 and 64.

Every configuration runs its shards as Ray actors (the same executor), one after another on
the same GPUs; TP=1 in the engine's own process ("uni") is measured too, as a user gets it by
default. The bound is each rank's share of the roofline (roofline.py: its weight and KV bytes
over the copy bandwidth, its FLOPs over the matmul rate, both measured in the run on one GPU):
TPOT at batch 1, output tokens/s at every batch. Greedy agreement between the first TP and the
others is reported for bf16.

    tandem bench tp-scaling --shape llama-3.1-8b --tp 1 2 4 8 --batch 1 64
    python -m cluster.bench tp-scaling --shape llama-3-70b --tp 4 8 --batch 1 100 --output-len 256
"""

import argparse
import functools
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from cluster.bench.report import machine_facts, markdown_table
from cluster.bench.roofline import (
    Ceilings,
    ModelCost,
    as_dict,
    latency_bound,
    measure_ceilings,
    model_cost,
    per_rank,
    workload_bound,
)
from cluster.bench.shapes import build_random_model
from cluster.engine.llm import LLM
from router.sampling_params import SamplingParams
from workers.loader import load_config

AGREEMENT_PROMPTS = 4
AGREEMENT_TOKENS = 32


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def timed_batch(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
             for o in outputs]
    return {"batch": len(prompts), "wall_s": wall, "tpot_ms_p50": 1e3 * statistics.median(tpots),
            "ttft_ms_p50": 1e3 * statistics.median(o.metrics.ttft for o in outputs),
            "output_tok_per_s": len(prompts) * output_len / wall}


def measure(folder: Path, tp: int, backend: str, args: argparse.Namespace,
            symmetric: bool = True) -> dict:
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    llm = LLM(str(folder), device=args.device, dtype=dtype, tensor_parallel_size=tp,
              distributed_executor_backend=backend, max_num_seqs=max(args.batch),
              gpu_memory_utilization=args.gpu_memory_utilization,
              symmetric_all_reduce=symmetric, decode_lookahead=args.decode_lookahead)
    vocab = llm.engine.vocab_size
    try:
        llm.generate(random_prompts(2, 16, vocab, 99), SamplingParams(max_tokens=8))  # warm up
        runs = [timed_batch(llm, random_prompts(b, args.prompt_len, vocab, b), args.output_len)
                for b in args.batch]
        if args.profile:  # one batch-1 request of 64 tokens, every rank's kernels
            tables = llm.engine.executor.profile(functools.partial(
                timed_batch, llm, random_prompts(1, args.prompt_len, vocab, 5), 64))
            for rank, table in enumerate(tables):
                print(f"\nTP={tp} ({backend}) rank {rank}, batch 1, 64 tokens:\n{table}")
        greedy = llm.generate(random_prompts(AGREEMENT_PROMPTS, args.prompt_len, vocab, 7),
                              SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS,
                                             ignore_eos=True))
        label = backend if tp == 1 else f"{backend}, {'peer-memory' if symmetric else 'NCCL'} sums"
        return {"tp": tp, "executor": label, "runs": runs,
                "greedy": [o.token_ids for o in greedy]}
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions equal before the first divergence, averaged over prompts."""
    prefix = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        prefix.append(same / len(x))
    return sum(prefix) / len(prefix)


def run_bounds(cost: ModelCost, num_kv_heads: int, tp: int, batch: int,
               args: argparse.Namespace, ceilings: Ceilings) -> dict:
    """The roofline of one run at this TP, per rank (roofline.per_rank): TPOT at batch 1, and
    output tokens/s of ``batch`` requests at once (``--batch 100``: the brief's 100
    concurrent requests of 256 output tokens)."""
    rank = per_rank(cost, tp, num_kv_heads)
    bound = workload_bound(rank, [args.prompt_len] * batch, [args.output_len] * batch, ceilings)
    tpot = latency_bound(rank, args.prompt_len, args.output_len, ceilings)["tpot_s"]
    return {"tpot_ms": 1e3 * tpot if batch == 1 else None,
            "output_tok_per_s": bound["output_tokens_per_s"]}


def table_rows(results: list[dict], cost: ModelCost, num_kv_heads: int,
               args: argparse.Namespace, ceilings: Ceilings) -> list[list]:
    base = results[0]
    rows = []
    for result in results:
        tp = result["tp"]
        for run, base_run in zip(result["runs"], base["runs"], strict=True):
            bound = run["bound"] = run_bounds(cost, num_kv_heads, tp, run["batch"], args,
                                              ceilings)
            speedup = base_run["tpot_ms_p50"] / run["tpot_ms_p50"]
            rows.append([f"{tp} ({result['executor']})", run["batch"], run["tpot_ms_p50"],
                         speedup, speedup / (tp / base["tp"]), bound["tpot_ms"],
                         bound["tpot_ms"] / run["tpot_ms_p50"] if bound["tpot_ms"] else None,
                         run["output_tok_per_s"], bound["output_tok_per_s"],
                         run["output_tok_per_s"] / bound["output_tok_per_s"],
                         run["ttft_ms_p50"]])
        result["greedy_agreement_with_first"] = agreement(base["greedy"], result["greedy"])
    return rows


def tp_scaling(args: argparse.Namespace) -> int:
    folder = Path(args.model) if args.model else build_random_model(args.shape,
                                                                     Path(args.model_root))
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    hf_config = load_config(folder)
    device = torch.device(args.device)
    # the files hold bf16 (a --shape's); the run's dtype: bf16 on a GPU, float32 on the CPU
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cost = model_cost(hf_config, dtype, weight_bytes // 2)
    ceilings = measure_ceilings(device)
    variants = {"symmetric": [True], "nccl": [False], "both": [False, True]}[args.all_reduce]
    results = [measure(folder, tp, "ray", args, symmetric)
               for tp in args.tp for symmetric in (variants if tp > 1 else [True])]
    if args.with_uni:
        results.append(measure(folder, 1, "uni", args))
    rows = table_rows(results, cost, hf_config.num_key_value_heads, args, ceilings)
    table = markdown_table(["TP (executor)", "batch", "TPOT p50 ms", "speedup vs first",
                            "scaling efficiency", "TPOT bound ms", "of TPOT bound",
                            "output tok/s", "bound tok/s", "of tok/s bound", "TTFT p50 ms"],
                           rows)
    print(table)
    for result in results:
        print(f"greedy agreement TP={result['tp']} ({result['executor']}) vs first: "
              f"{result['greedy_agreement_with_first']:.3f}")
    record = {"workload": "W7", "shape": args.shape, "args": vars(args),
              "environment": machine_facts(device), "ceilings": as_dict(ceilings),
              "weight_bytes": weight_bytes, "results": results, "table": table}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2, default=str))
    return 0

