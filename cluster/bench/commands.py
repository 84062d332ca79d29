"""One function per workload: tandem, then the HF baseline, then the roofline, in one run."""

import argparse
import random
import time
from pathlib import Path

import torch
from safetensors import safe_open

from cluster import environment
from cluster.bench import hf_baseline as hf
from cluster.bench import roofline
from cluster.bench.engine_runs import (
    engine_summary,
    greedy,
    make_llm,
    percentiles,
    release,
    run_requests,
)
from cluster.bench.prefix_replicas import engine_config as replica_config
from cluster.bench.prefix_replicas import prefix_replicas
from cluster.bench.prefix_tiers import prefix_tiers
from cluster.bench.report import machine_facts, markdown_table, publish, write_json
from cluster.bench.shapes import build_random_model
from cluster.bench.triton_compiles import CompileLog
from cluster.bench.workloads import (
    Request,
    arrival_times,
    ideal_prefix_hit_rate,
    latency_prompt,
    prefix_requests,
    skewed_prefix_requests,
    throughput_requests,
)
from workers.catalog import resolve_model
from workers.loader import load_config, weight_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bench_dtype(name: str, device: torch.device) -> torch.dtype:
    """--dtype: as named, or for ``auto`` bfloat16 on a GPU and float32 on the CPU."""
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return DTYPES[name]


def count_parameters(folder: Path) -> int:
    total = 0
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shape = f.get_slice(name).get_shape()
                total += int(torch.Size(shape).numel())
    return total


class Setup:
    """What every workload shares: device, dtype, model folder, its cost, the ceilings."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.compiles = CompileLog.start()
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = bench_dtype(args.dtype, self.device)
        if args.shape:
            root = Path(args.model_cache or environment.cache_dir() / "bench-models")
            self.folder = build_random_model(args.shape, root)
        else:
            self.folder = resolve_model(args.model, environment.cache_dir())
        self.hf_config = load_config(self.folder)
        self.cost = roofline.model_cost(self.hf_config, self.dtype, count_parameters(self.folder))
        print(f"measuring ceilings on {self.device} ...")
        self.ceilings = roofline.measure_ceilings(self.device, self.dtype)
        self.record = {
            "config": vars(args) | {"model_folder": str(self.folder),
                                    "dtype": str(self.dtype).removeprefix("torch.")},
            "environment": machine_facts(self.device),
            "ceilings": roofline.as_dict(self.ceilings),
            "model_cost": vars(self.cost),
        }

    @property
    def vocab_size(self) -> int:
        return min(self.hf_config.vocab_size, 10001)

    def engine(self, **overrides):
        a = self.args
        engine_args = dict(
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
            max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
            enforce_eager=a.enforce_eager, decode_steps=a.decode_steps,
            decode_lookahead=a.decode_lookahead, async_scheduling=a.async_scheduling,
            gpu_memory_utilization=a.gpu_memory_utilization,
            cpu_kv_cache_gb=a.cpu_kv_cache_gb, attention_backend=a.attention_backend,
            seed=a.seed, block_size=a.block_size, kv_cache_dtype=a.kv_cache_dtype,
        )
        return make_llm(self.folder, **(engine_args | overrides))

    def run(self, llm, requests: list[Request], arrivals: list[float] | None = None) -> dict:
        return run_requests(llm, requests, self.device, self.compiles, arrivals)

    def hf_model(self):
        return hf.load_hf_model(self.folder, self.dtype, self.device)


def step_latencies(llm, request: Request) -> dict:
    """Batch 1, one engine step at a time: TTFT, then the gap each token cost (a step that
    ran several decode steps spreads its time over its tokens) and the decode rate."""
    engine = llm.engine
    engine.add_request(request.prompt_token_ids, greedy(request))
    start, stamps, tokens = time.perf_counter(), [], []
    gaps: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            new = len(out.token_ids) - len(tokens)
            if stamps and new:
                gaps += [(now - stamps[-1]) / new] * new
            stamps.append(now)
            tokens = out.token_ids
    decode_s = stamps[-1] - stamps[0]
    return {"ttft_s": stamps[0] - start, "tpot": percentiles(gaps), "token_ids": tokens,
            "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None}


def compare_backends(setup: Setup, prompt: list[int], num_tokens: int = 32) -> dict:
    """Greedy tokens of the Triton and reference backends in float32 (GPU check)."""
    tokens = {}
    for backend in ("reference", "triton"):
        llm = setup.engine(dtype="float32", attention_backend=backend, num_kv_blocks=256)
        tokens[backend] = step_latencies(llm, Request(prompt, num_tokens))["token_ids"]
        release(llm)
    same = tokens["reference"] == tokens["triton"]
    first_diff = next((i for i, (a, b) in enumerate(zip(*tokens.values(), strict=True))
                       if a != b), None)
    return {"num_tokens": num_tokens, "equal": same, "first_difference": first_diff}


def latency(args: argparse.Namespace) -> int:
    setup = Setup(args)
    prompt = latency_prompt(args.prompt_len, setup.vocab_size, args.seed)
    llm = setup.engine()
    step_latencies(llm, Request(prompt, 16))  # warm-up
    runs = [step_latencies(llm, Request(prompt, args.output_len)) for _ in range(args.repeats)]
    engine_info = engine_summary(llm)
    if args.profile and setup.device.type == "cuda":
        from cluster.bench.profiling import graph_replay_seconds, profile_steps

        engine_info["graph_replay_s_batch1"] = graph_replay_seconds(llm)
        engine_info["profile"] = profile_steps(lambda: step_latencies(llm, Request(prompt, 32)))
        print(engine_info["profile"])
        print("graph replay, batch 1:", engine_info["graph_replay_s_batch1"])
    release(llm)
    median = sorted(runs, key=lambda run: run["decode_tokens_per_s"])[len(runs) // 2]
    tandem = {"ttft_s": sorted(r["ttft_s"] for r in runs)[len(runs) // 2],
              "tpot_s": median["tpot"], "tokens_per_s": median["decode_tokens_per_s"],
              "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}
    checks = compare_backends(setup, prompt) if args.compare_backends else None
    baseline = None
    if not args.no_hf:
        model = setup.hf_model()
        baseline = hf.generate_latency(model, prompt, args.hf_output_len, setup.device)
        del model
        release(None)
    bound = roofline.latency_bound(setup.cost, args.prompt_len, args.output_len, setup.ceilings)
    tandem["percent_of_roofline"] = 100 * tandem["tokens_per_s"] / bound["tokens_per_s"]
    rows = [["tandem", tandem["ttft_s"] * 1e3, median["tpot"]["p50"] * 1e3,
             median["tpot"]["p99"] * 1e3, tandem["tokens_per_s"], tandem["percent_of_roofline"]]]
    if baseline:
        rows.append(["HF generate()", baseline["ttft_s"] * 1e3, baseline["tpot_s"] * 1e3, None,
                     baseline["tokens_per_s"],
                     100 * baseline["tokens_per_s"] / bound["tokens_per_s"]])
    rows.append(["roofline", None, bound["tpot_s"] * 1e3, None, bound["tokens_per_s"], 100.0])
    table = markdown_table(["W1 batch 1", "TTFT ms", "TPOT p50 ms", "TPOT p99 ms", "tok/s",
                            "% of roofline"], rows)
    record = setup.record | {"workload": "latency", "engine": engine_info, "tandem": tandem,
                             "hf_generate": baseline, "roofline": bound,
                             "backend_check_fp32": checks}
    publish(record, table, args.output)
    return 0


def throughput(args: argparse.Namespace) -> int:
    setup = Setup(args)
    requests = throughput_requests(args.num_requests, args.min_len, args.max_len,
                                   setup.vocab_size, args.seed)
    llm = setup.engine()
    setup.run(llm, [Request(r.prompt_token_ids, 8) for r in requests[:8]])
    tandem = setup.run(llm, requests)
    tandem.pop("token_ids")
    engine_info = engine_summary(llm)
    release(llm)
    if args.output:  # tandem's figures survive a baseline that fails or runs out of time
        write_json(setup.record | {"workload": "throughput", "tandem": tandem}, args.output, "")
    generate, batched = None, None
    if not args.no_hf:
        model = setup.hf_model()
        sizes = sorted({min(int(b), len(requests)) for b in args.hf_batch_sizes.split(",")})
        generate = hf.generate_throughput(model, requests, sizes, args.hf_max_new_tokens,
                                          setup.device)
        if args.hf_batch_requests:
            batched = hf.generate_batch_throughput(model, requests[: args.hf_batch_requests],
                                                   args.hf_max_new_tokens, setup.device)
        del model
        release(None)
    bound = roofline.workload_bound(setup.cost, [len(r.prompt_token_ids) for r in requests],
                                    [r.max_tokens for r in requests], setup.ceilings)
    hf_rates = [generate["best"]["output_tokens_per_s"]] if generate else []
    if batched and "output_tokens_per_s" in batched:
        hf_rates.append(batched["output_tokens_per_s"])
    summary = {"percent_of_roofline": 100 * tandem["output_tokens_per_s"]
               / bound["output_tokens_per_s"],
               "speedup_vs_best_hf": (tandem["output_tokens_per_s"] / max(hf_rates)
                                      if hf_rates else None)}
    rows = [["tandem", tandem["seconds"], tandem["output_tokens_per_s"],
             summary["percent_of_roofline"], tandem["peak_memory_bytes"]]]
    if generate:
        best = generate["best"]
        rows.append([hf.generate_label(best), best["seconds"], best["output_tokens_per_s"],
                     None, None])
    if batched and "output_tokens_per_s" in batched:
        rows.append([f"HF generate_batch() ({batched['num_requests']} requests, "
                     f"{batched['new_tokens']} new)", batched["seconds"],
                     batched["output_tokens_per_s"], None, None])
    rows.append(["roofline", bound["seconds"], bound["output_tokens_per_s"], 100.0, None])
    table = markdown_table(["W2", "seconds", "output tok/s", "% of roofline", "peak bytes"],
                           rows)
    if summary["speedup_vs_best_hf"]:
        table += f"\n\ntandem / best HF: {summary['speedup_vs_best_hf']:.1f}x"
    table += compiles_note(tandem)
    record = setup.record | {"workload": "throughput", "engine": engine_info, "tandem": tandem,
                             "hf_generate": generate, "hf_generate_batch": batched,
                             "roofline": bound, "summary": summary}
    publish(record, table, args.output)
    return 0


def compiles_note(run: dict) -> str:
    """A line naming the Triton kernels compiled inside a timed run (none after a full warm-up)."""
    if not run["triton_compiles"]:
        return ""
    names = sorted({entry.split()[0] for entry in run["triton_compiles"]})
    return (f"\n\n{len(run['triton_compiles'])} Triton compiles inside the timed run: "
            + ", ".join(names))


def prefix(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.request_rate < 0:
        raise ValueError(f"--request-rate must be at least 0, got {args.request_rate}")
    setup = Setup(args)
    shape = (args.num_groups, args.group_size, args.prefix_len, args.question_len)
    make_requests = skewed_prefix_requests if args.skewed else prefix_requests
    requests = make_requests(*shape, args.output_len, setup.vocab_size, args.seed)
    if args.interleaved:  # as users of many groups arrive: mixed (the prefixes are the same)
        random.Random(args.seed).shuffle(requests)
    if args.pass_major:  # request i of every group, then i + 1: group-major order turned
        requests = [requests[g * args.group_size + i] for i in range(args.group_size)
                    for g in range(args.num_groups)]
    warmup = prefix_requests(1, 2, args.prefix_len, args.question_len, 4, setup.vocab_size,
                             args.seed + 1)
    if args.replicas > 1:
        return prefix_on_replicas(args, setup, requests, warmup)
    # seeded: every run sees the same arrival times; None: all at once
    arrivals = arrival_times(len(requests), args.request_rate, args.seed) \
        if args.request_rate > 0 else None
    if args.host_kv_cache_gb > 0:
        return prefix_tiers(args, setup, requests, warmup, arrivals)
    results = {}
    for cache in (True, False):
        llm = setup.engine(enable_prefix_caching=cache, num_kv_blocks=args.num_kv_blocks)
        setup.run(llm, warmup)
        results["on" if cache else "off"] = setup.run(llm, requests, arrivals)
        results["on" if cache else "off"].pop("token_ids")
        release(llm)
    on, off = results["on"], results["off"]
    ideal = ideal_prefix_hit_rate(*shape, args.block_size)
    ideal_computed = on["prompt_tokens"] * (1 - ideal)
    summary = {"ideal_hit_rate": ideal,
               "hit_rate": on["prompt_tokens_cached"] / on["prompt_tokens"],
               "computed_over_ideal": on["prompt_tokens_computed"] / ideal_computed,
               "ttft_p50_ratio_off_over_on": off["ttft_s"]["p50"] / on["ttft_s"]["p50"]}
    rows = [[f"cache {name}", r["prompt_tokens_computed"], r["prompt_tokens_cached"],
             r["ttft_s"]["p50"] * 1e3, r["ttft_s"]["p99"] * 1e3, r["output_tokens_per_s"],
             r["seconds"]] for name, r in results.items()]
    rows.append(["ideal", round(ideal_computed), round(on["prompt_tokens"] * ideal), None, None,
                 None, None])
    table = markdown_table(["W4", "prompt tokens computed", "cached", "TTFT p50 ms",
                            "TTFT p99 ms", "output tok/s", "seconds"], rows)
    table += (f"\n\nhit rate {100 * summary['hit_rate']:.1f}% (ideal {100 * ideal:.1f}%), "
              f"computed / ideal {summary['computed_over_ideal']:.3f}, TTFT p50 off / on "
              f"{summary['ttft_p50_ratio_off_over_on']:.1f}x")
    record = setup.record | {"workload": "prefix", "cache_on": on, "cache_off": off,
                             "summary": summary}
    publish(record, table, args.output)
    return 0


def prefix_on_replicas(args: argparse.Namespace, setup: Setup, requests: list[Request],
                       warmup: list[Request]) -> int:
    ideal = ideal_prefix_hit_rate(args.num_groups, args.group_size, args.prefix_len,
                                  args.question_len, args.block_size)
    if args.skewed:  # the same prefixes, computed once each; no closed form: count them
        num_groups = len({tuple(r.prompt_token_ids[: args.prefix_len]) for r in requests})
        cached = (len(requests) - num_groups) * (args.prefix_len // args.block_size
                                                 * args.block_size)
        ideal = cached / sum(len(r.prompt_token_ids) for r in requests)
    ideal_computed = sum(len(r.prompt_token_ids) for r in requests) * (1 - ideal)
    dtype = str(setup.dtype).removeprefix("torch.")
    config = replica_config(args, str(setup.folder), dtype, str(setup.device))
    results, table = prefix_replicas(args, config, requests, warmup, ideal_computed)
    table += f"\n\nthe single-replica ideal: {round(ideal_computed)} prompt tokens computed"
    record = setup.record | {"workload": "prefix-replicas", "replicas": args.replicas,
                             "skewed": args.skewed, "ideal_computed": ideal_computed,
                             "results": results}
    publish(record, table, args.output)
    return 0
