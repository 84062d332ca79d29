"""W4 with KV tiers (`tandem bench prefix --host-kv-cache-gb G`): the same requests through
one engine three ways — recompute (the device prefix cache alone), a host tier of G GiB, and
(with --disk-kv-cache-dir) a host tier of G/4 over the disk tier, so that most repeats come
back from disk. With --num-kv-blocks a quarter of the prefixes' blocks and --pass-major, every
prefix comes back after the device cache has evicted it.

Each run reports prompt tokens computed, TTFT, TPOT and throughput, the bytes the tiers moved,
and the transfer rate: device <-> host bytes over their time on the copy stream (rank 0's
CUDA events), against the host-copy bandwidth the engine measured at start-up in the run.
"""

import argparse
import shutil

from cluster.bench.engine_runs import percentiles, release
from cluster.bench.report import markdown_table, publish
from cluster.bench.workloads import Request

GB = 1e9


def tier_runs(args: argparse.Namespace) -> dict[str, dict]:
    runs = {"recompute": {}, "host": {"host_kv_cache_gb": args.host_kv_cache_gb}}
    if args.host_loads_in_place:
        runs["host, in place"] = {"host_kv_cache_gb": args.host_kv_cache_gb,
                                  "host_loads_in_place": True}
    if args.disk_kv_cache_dir:
        runs["host+disk"] = {"host_kv_cache_gb": args.host_kv_cache_gb / 4,
                             "disk_kv_cache_dir": args.disk_kv_cache_dir,
                             "disk_kv_cache_gb": args.disk_kv_cache_gb}
    return runs


def tier_figures(llm) -> dict:
    """What the engine's tiers moved, and how fast, since it started."""
    engine = llm.engine
    tiers = engine.scheduler.kv.tiers
    rates = engine.transfer_rates
    live = engine.scheduler.rates
    if tiers is None:
        return {}
    counters = tiers.counters
    block = engine.offload_block_bytes
    return {
        "host_copy_gb_per_s_measured": rates.host_copy_bytes_per_s / GB if rates else None,
        "prefill_tokens_per_s_measured": rates.prefill_tokens_per_s if rates else None,
        # what loading adds to a step, the start-up probe's (a GPU's; 0: not measured)
        "load_gb_per_s_measured": rates.load_bytes_per_s / GB if rates else None,
        # the loads' rate the engine ended with (router/live_rates.py)
        "load_gb_per_s_live": (live.current().load_bytes_per_s / GB if live else None),
        # what a block's store costs: the start-up probe's copy out (a GPU's; 0: not measured)
        # and the host's time planning it (kvstore/tiers.py take)
        "store_us_per_block_measured": rates.store_seconds_per_block * 1e6 if rates else None,
        "store_plan_us_per_block": counters.plan_seconds_per_block() * 1e6,
        "transfer_gb_per_s": (counters.copied_bytes / counters.copy_seconds / GB
                              if counters.copy_seconds else None),
        "copied_gb": counters.copied_bytes / GB,
        "stored_to_host_gb": counters.stored_to_host * block / GB,
        "not_written_gb": counters.not_written * block / GB,  # priced out of the write-through
        "loaded_from_host_gb": counters.loaded_from_host * block / GB,
        "written_to_disk_gb": counters.written_to_disk * block / GB,
        "read_from_disk_gb": counters.read_from_disk * block / GB,
        "host_cache_hits": llm.stats().host_cache_hits,
        "disk_cache_hits": llm.stats().disk_cache_hits,
    }


def pass_ttfts(ttfts: list[float], args: argparse.Namespace) -> dict:
    """TTFT of the first pass over the groups (every prefix new: the tiers' stores) and of
    the repeats (the tiers' loads), where requests come pass by pass (--pass-major)."""
    if not args.pass_major:
        return {}
    return {"ttft_first_pass_s": percentiles(ttfts[:args.num_groups]),
            "ttft_repeats_s": percentiles(ttfts[args.num_groups:])}


def prefix_tiers(args: argparse.Namespace, setup, requests: list[Request],
                 warmup: list[Request], arrivals: list[float] | None = None) -> int:
    """``arrivals``: each request's time from the start (None: all at once)."""
    results = {}
    for name, options in tier_runs(args).items():
        if "disk_kv_cache_dir" in options:  # an empty tier: its blocks come from this run
            shutil.rmtree(options["disk_kv_cache_dir"], ignore_errors=True)
        llm = setup.engine(num_kv_blocks=args.num_kv_blocks, **options)
        setup.run(llm, warmup)
        before = tier_figures(llm)
        result = setup.run(llm, requests, arrivals)
        result.pop("token_ids")
        result |= pass_ttfts(result.pop("ttft_each_s"), args)
        after = tier_figures(llm)
        for hits in ("host_cache_hits", "disk_cache_hits"):  # this run's, not the warm-up's
            if hits in after:
                after[hits] -= before[hits]
        result["tiers"] = after
        results[name] = result
        release(llm)
        print(f"{name}: computed {result['prompt_tokens_computed']}, TTFT p50 "
              f"{result['ttft_s']['p50'] * 1e3:.0f} ms p99 {result['ttft_s']['p99'] * 1e3:.0f} ms"
              f", {result['output_tokens_per_s']:.0f} output tok/s, tiers {after}", flush=True)
    passes = "ttft_repeats_s" in results["recompute"]
    rows = []
    for name, r in results.items():
        t = r["tiers"]
        rate = t.get("transfer_gb_per_s")
        measured = t.get("host_copy_gb_per_s_measured")
        rows.append([name, r["prompt_tokens_computed"], r["ttft_s"]["p50"] * 1e3,
                     r["ttft_s"]["p99"] * 1e3, r["tpot_s"]["p50"] * 1e3,
                     r["output_tokens_per_s"], r["total_tokens_per_s"],
                     rate, measured, t.get("host_cache_hits"), t.get("disk_cache_hits")]
                    + ([r["ttft_first_pass_s"]["p50"] * 1e3, r["ttft_repeats_s"]["p50"] * 1e3]
                       if passes else []))
    load = f", {args.request_rate:g} req/s" if arrivals is not None else ", all at once"
    table = markdown_table([f"W4 tiers{load}", "prompt tokens computed", "TTFT p50 ms",
                            "TTFT p99 ms", "TPOT p50 ms", "output tok/s", "total tok/s",
                            "transfer GB/s", "host copy GB/s (measured)", "host hits",
                            "disk hits"]
                           + (["TTFT p50 first pass ms", "TTFT p50 repeats ms"] if passes else []),
                           rows)
    recompute = results["recompute"]["ttft_s"]["p50"]
    table += f"\n\nTTFT p50 recompute / host {recompute / results['host']['ttft_s']['p50']:.1f}x"
    if "host+disk" in results:
        table += f", recompute / host+disk {recompute / results['host+disk']['ttft_s']['p50']:.1f}x"
    record = setup.record | {"workload": "prefix-tiers", "results": results}
    publish(record, table, args.output)
    return 0
