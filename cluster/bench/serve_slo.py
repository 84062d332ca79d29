"""`tandem bench serve`'s capacity bound and SLO sweep: how many requests a second the load
could have on this hardware (cluster/bench/roofline.py, ``serving_bound``), and the highest
Poisson rate each path (in-process, HTTP) serves within the SLO (cluster/bench/slo.py)."""

import argparse
from pathlib import Path

from cluster.bench.serve_load import Load, Runner, goodput_slo, run_loads
from cluster.bench.slo import DEFAULT_GOODPUT, DEFAULT_SLO, find_slo_rate, parse_slo

FIRST_RATE_SHARE = 0.25  # the sweep starts at this share of the bound
FIRST_RATE_WITHOUT_BOUND = 1.0  # req/s, with --base-url (no bound is known)


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                        help="a request is good when each figure is below its limit, in ms, "
                        "keys ttft, tpot, e2el (vLLM's flag; default: "
                        f"{' '.join(DEFAULT_GOODPUT)})")
    parser.add_argument("--find-slo-rate", action="store_true",
                        help="after the loads, sweep Poisson rates for the highest that meets "
                        "--slo at the 90th percentile, on each path")
    parser.add_argument("--slo", nargs="+", metavar="KEY:MS",
                        help="the sweep's limits on each figure's p90, in ms (default: "
                        f"{' '.join(DEFAULT_SLO)})")
    parser.add_argument("--slo-first-rate", type=float, metavar="R",
                        help="the sweep's first rate in req/s (default: a quarter of the "
                        f"bound, {FIRST_RATE_WITHOUT_BOUND:g} without one)")


def check_slo_arguments(args: argparse.Namespace) -> None:
    """Bad limits fail before anything starts."""
    goodput_slo(args)
    parse_slo(args.slo or DEFAULT_SLO, "--slo")
    if args.slo_first_rate is not None and not args.slo_first_rate > 0:
        raise ValueError(f"--slo-first-rate must be above 0, not {args.slo_first_rate:g}")


def measure_bound(args: argparse.Namespace, config) -> dict:  # type: ignore[no-untyped-def]
    """The load's bound on this machine's measured ceilings (before the cluster starts: the
    copy and the matmul need the device to themselves), for every replica together."""
    import torch

    from cluster import environment
    from cluster.bench import roofline
    from cluster.bench.commands import bench_dtype, count_parameters
    from workers.catalog import resolve_model
    from workers.loader import load_config as load_hf_config

    engine = config.engine_config()
    device = torch.device(engine.resolved_device)
    folder = resolve_model(args.model, environment.cache_dir())
    hf_config = load_hf_config(folder)
    dtype = bench_dtype(args.dtype, device)
    cost = roofline.per_rank(roofline.model_cost(hf_config, dtype, count_parameters(folder)),
                             args.tp, hf_config.num_key_value_heads)
    ceilings = roofline.measure_ceilings(device, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV cache by the memory left free
    bound = roofline.serving_bound(cost, ceilings, args.input_len, args.output_len,
                                   args.max_num_seqs)
    for key in ("requests_per_s", "output_tokens_per_s"):
        bound[key] *= args.replicas
    bound |= {"replicas": args.replicas, "ceilings": roofline.as_dict(ceilings)}
    print(f"bound: {bound['requests_per_s']:.1f} req/s, {bound['output_tokens_per_s']:.0f} "
          f"output tok/s (prefill {bound['prefill_s'] * 1e3:.2f} ms, decode step "
          f"{bound['decode_step_s'] * 1e3:.2f} ms at batch {bound['batch']})")
    return bound


async def sweep(path: str, args: argparse.Namespace, vocab: int, bound: dict | None,
                runner: Runner) -> dict:
    """The highest Poisson rate ``runner`` serves within --slo, with its share of the bound."""
    slo = parse_slo(args.slo or DEFAULT_SLO, "--slo")
    first = args.slo_first_rate or (FIRST_RATE_SHARE * bound["requests_per_s"] if bound
                                    else FIRST_RATE_WITHOUT_BOUND)
    print(f"{path}: the highest Poisson rate with p90 {slo.text} (ms), from {first:.3g} req/s")

    # each probe 8 s of arrivals (at least 32), whatever --num-prompts says: a backlog that a
    # rate above the server's builds must have the time to show
    probe_args = argparse.Namespace(**{**vars(args), "num_requests": 0})

    async def probe(rate: float) -> dict:
        load = Load(rate=rate)
        return (await run_loads(None, probe_args, [load], vocab, runner=runner))[load.name]

    found = await find_slo_rate(probe, slo, first)
    rate = found["rate"]
    share = rate / bound["requests_per_s"] if bound and rate else None
    found["share_of_bound"] = share
    print(f"{path}: {'no rate' if rate is None else f'{rate:.3g} req/s'} meets p90 "
          f"{slo.text}" + (f", {share:.0%} of the bound" if share else ""))
    return found


def slo_table(bound: dict | None, sweeps: dict[str, dict]) -> str:
    """A row a path: the rate found, the first that missed, the share of the bound."""
    from cluster.bench.report import markdown_table

    def rate(value: float | None) -> str:
        return "—" if value is None else f"{value:.3g}"

    rows = []
    for path, found in sweeps.items():
        share = found["share_of_bound"]
        rows.append([path, found["slo"], rate(found["rate"]), rate(found["first_rate_missed"]),
                     rate(bound["requests_per_s"]) if bound else "—",
                     "—" if share is None else f"{share:.0%}", len(found["probes"])])
    return markdown_table(["path", "SLO (p90, ms)", "highest rate req/s", "first missed",
                           "bound req/s", "share of bound", "probes"], rows)


def plot_sweeps(path: str, sweeps: dict[str, dict]) -> None:
    """Each path's probes by rate, to <path>-slo-rate-<path name>.png (each path probed rates
    of its own: a figure a path)."""
    from cluster.bench.plots import plot_loads

    for name, found in sweeps.items():
        probes = sorted(found["probes"], key=lambda probe: probe["rate"])
        sweep_path = f"{Path(path).with_suffix('')}-slo-rate-{name}.png"
        plot_loads(sweep_path, {name: {f"{p['rate']:.4g} req/s": p["result"] for p in probes}})
        print(f"wrote {sweep_path}")
