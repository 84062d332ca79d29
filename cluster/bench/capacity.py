"""`tandem bench capacity` — W6: what a quantized KV cache buys, each format in one run.

For every KV cache format (the model's dtype, int8, fp8) an engine is sized from memory as in
serving, and the run records:

- its KV blocks, and the sequences of ``--prompt-len`` + ``--output-len`` tokens they hold;
- TPOT at batch 1 (a ``--prompt-len`` prompt, ``--tpot-tokens`` greedy tokens), where the
  step reads the weights and one sequence's KV: quantized blocks may cost only their
  dequantization here;
- output tokens/s of ``--concurrency`` such requests at once, by default as many as the
  first quantized format holds: more than the unquantized cache holds, so that engine must
  queue or preempt what the others run together.

Prompts are seeded random token ids, one seed a request, and prefix caching is off: no request
shares blocks with another. Two passes (sizing and TPOT, then throughput) build each engine
twice, because the throughput run's concurrency is known only after every engine is sized.
"""

import argparse

from cluster.bench.report import markdown_table
from cluster.bench.workloads import Request, latency_prompt


def blocks_per_sequence(prompt_len: int, output_len: int, block_size: int) -> int:
    return -(-(prompt_len + output_len) // block_size)


def default_concurrency(sizing: dict[str, dict]) -> int:
    """The most sequences the first quantized format holds (the unquantized one's if none)."""
    quantized = [name for name in sizing if name != "auto"]
    return sizing[quantized[0] if quantized else "auto"]["max_sequences"]


def run_capacity(args: argparse.Namespace) -> int:
    from cluster.bench.commands import Setup, step_latencies
    from cluster.bench.engine_runs import release
    from cluster.bench.report import publish

    setup = Setup(args)
    per_sequence = blocks_per_sequence(args.prompt_len, args.output_len, args.block_size)
    options = {"enable_prefix_caching": False,
               "max_model_len": args.prompt_len + args.output_len}
    sizing: dict[str, dict] = {}
    for name in args.formats:  # pass 1: blocks, sequences, TPOT at batch 1
        # the allocator's cache of what ran before (the ceilings' buffers, the last engine)
        # would count as this engine's memory and shrink its KV pool
        release(None)
        llm = setup.engine(kv_cache_dtype=name, **options)
        blocks = llm.stats().kv_blocks_total
        prompt = latency_prompt(args.prompt_len, setup.vocab_size, args.seed)
        step_latencies(llm, Request(prompt, 8))  # warm-up: kernels compiled, graphs replayed
        tpot = step_latencies(llm, Request(prompt, args.tpot_tokens))["tpot"]
        sizing[name] = {"kv_blocks": blocks, "max_sequences": blocks // per_sequence,
                        "tpot_batch1_s": tpot}
        release(llm)
        print(f"  {name}: {blocks} blocks, {blocks // per_sequence} sequences", flush=True)
    concurrency = args.concurrency or default_concurrency(sizing)
    requests = [Request(latency_prompt(args.prompt_len, setup.vocab_size, args.seed + 1 + i),
                        args.output_len) for i in range(concurrency)]
    warmup = [Request(r.prompt_token_ids[: args.block_size], 4) for r in requests[:4]]
    for name in args.formats:  # pass 2: throughput at the concurrency
        llm = setup.engine(kv_cache_dtype=name, max_num_seqs=max(concurrency, 1), **options)
        setup.run(llm, warmup)
        run = setup.run(llm, requests)
        run.pop("token_ids")
        sizing[name]["throughput"] = run
        release(llm)
        print(f"  {name}: {run['output_tokens_per_s']:.0f} output tok/s at {concurrency}, "
              f"{run['num_preemptions']} preemptions", flush=True)
    table = capacity_table(args, sizing, concurrency)
    record = setup.record | {"workload": "capacity", "concurrency": concurrency,
                             "blocks_per_sequence": per_sequence, "results": sizing}
    publish(record, table, args.output)
    return 0


def capacity_table(args: argparse.Namespace, sizing: dict[str, dict], concurrency: int) -> str:
    base = sizing.get("auto")

    def ratio(value: float | None, key) -> float | None:  # type: ignore[no-untyped-def]
        reference = key(base) if base else None
        return value / reference if value is not None and reference else None

    rows = []
    for name, s in sizing.items():
        rate = s["throughput"]["output_tokens_per_s"]
        tpot = s["tpot_batch1_s"]["p50"]
        rows.append([name, s["kv_blocks"], s["max_sequences"],
                     ratio(s["max_sequences"], lambda b: b["max_sequences"]), rate,
                     ratio(rate, lambda b: b["throughput"]["output_tokens_per_s"]),
                     s["throughput"]["num_preemptions"],
                     tpot * 1e3 if tpot is not None else None,
                     ratio(tpot, lambda b: b["tpot_batch1_s"]["p50"])])
    return markdown_table([f"W6 ({args.prompt_len} + {args.output_len} tokens)", "KV blocks",
                           "max sequences", "x auto", f"output tok/s at {concurrency}",
                           "x auto", "preemptions", "TPOT batch 1 ms", "x auto"], rows)


def add_capacity_parser(workloads: argparse._SubParsersAction,
                        common_arguments) -> None:  # type: ignore[no-untyped-def]
    parser = workloads.add_parser("capacity", help="W6: KV blocks, sequences, throughput and "
                                  "TPOT of each KV cache format")
    common_arguments(parser)
    parser.add_argument("--formats", nargs="+", choices=["auto", "int8", "fp8"],
                        default=["auto", "int8", "fp8"], help="KV cache formats, in order")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--tpot-tokens", type=int, default=128,
                        help="greedy tokens of the batch-1 TPOT run")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="requests of the throughput run (0: as many as the first "
                        "quantized format holds)")
    parser.set_defaults(handler=run_capacity)
