"""`tandem bench serve` as vLLM's `vllm bench serve`: the flags, the loads they make, vLLM's
result keys from hand-made timings, the file name, the record and the plot."""

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.bench import plots
from cluster.bench.http_clients import split_load
from cluster.bench.process_cpu import CpuMeter, cpu_seconds, process_name
from cluster.bench.serve_bench import api_root, base_url_record, parse_loads
from cluster.bench.serve_load import Load, Timing, num_prompts, run_load, run_loads
from cluster.bench.vllm_results import (
    latency_stats,
    result_file_name,
    traffic_keys,
    vllm_metrics,
)
from cluster.cli.main import build_parser, main

# four requests over 4 s: two that stream several chunks, one of a single token, one that failed
TIMINGS = [
    Timing(start=0.0, chunk_times=[0.5, 1.0, 1.5, 2.0], end=2.0, output_tokens=4),
    Timing(start=1.0, chunk_times=[2.0, 4.0], end=4.0, output_tokens=3),  # a chunk of 2 tokens
    Timing(start=2.0, chunk_times=[2.25], end=2.5, output_tokens=1),  # no TPOT, no ITL
    Timing(start=3.0, end=3.5),  # never streamed: failed, left out of every figure
]
INPUT_LENS = [10, 20, 30, 40]


def population_std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def test_vllm_metrics_of_hand_made_timings():
    metrics = vllm_metrics(TIMINGS, 4.0, INPUT_LENS)
    assert metrics == pytest.approx({
        "duration": 4.0, "completed": 3, "failed": 1,
        "total_input_tokens": 60, "total_output_tokens": 8,  # 10 + 20 + 30; 4 + 3 + 1
        "request_throughput": 0.75, "output_throughput": 2.0, "total_token_throughput": 17.0,
        # TTFT 500, 1000, 250 ms; p99 interpolates between the 2nd and 3rd: 500 + 0.98 * 500
        "mean_ttft_ms": 1750 / 3, "median_ttft_ms": 500.0,
        "std_ttft_ms": population_std([500, 1000, 250]), "p99_ttft_ms": 990.0,
        # TPOT (e2e - TTFT) / (output - 1): 1.5 s / 3 and 2 s / 2
        "mean_tpot_ms": 750.0, "median_tpot_ms": 750.0, "std_tpot_ms": 250.0,
        "p99_tpot_ms": 995.0,
        # ITL: 500, 500, 500 (the first request) and 2000 (the second)
        "mean_itl_ms": 875.0, "median_itl_ms": 500.0,
        "std_itl_ms": population_std([500, 500, 500, 2000]), "p99_itl_ms": 1955.0,
        "mean_e2el_ms": 5500 / 3, "median_e2el_ms": 2000.0,
        "std_e2el_ms": population_std([2000, 3000, 500]), "p99_e2el_ms": 2980.0,
    })
    assert metrics["completed"] == 3 and metrics["total_input_tokens"] == 60


def test_a_latency_with_nothing_to_measure_is_zero_as_in_vllm():
    assert latency_stats("tpot", []) == {"mean_tpot_ms": 0.0, "median_tpot_ms": 0.0,
                                         "std_tpot_ms": 0.0, "p99_tpot_ms": 0.0}


def test_traffic_keys_and_vllm_file_name():
    assert traffic_keys(None, math.inf) == {"max_concurrency": None, "request_rate": "inf"}
    assert traffic_keys(None, None) == {"max_concurrency": None, "request_rate": "inf"}
    assert traffic_keys(2, 4.0) == {"max_concurrency": 2, "request_rate": 4.0}
    one = [{"request_rate": "inf", "max_concurrency": 2}]
    assert result_file_name("openai", one, "org/smollm2", "20250101-120000") == (
        "openai-infqps-concurrency2-smollm2-20250101-120000.json")
    sweep = [{"request_rate": 1.0, "max_concurrency": None},
             {"request_rate": 4.0, "max_concurrency": None}]
    assert result_file_name("tandem", sweep, "m", "t") == "tandem-1.0_4.0qps-m-t.json"


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *flags])


def test_vllm_flags_are_aliases_of_tandems():
    vllm = serve_args("--dataset-name", "random", "--random-input-len", "32",
                      "--random-output-len", "8", "--num-prompts", "6", "--max-concurrency", "2")
    tandem = serve_args("--input-len", "32", "--output-len", "8", "--num-requests", "6",
                        "--concurrency", "2")
    assert vars(vllm) == vars(tandem)
    assert (vllm.input_len, vllm.output_len, vllm.num_requests, vllm.concurrency) == (
        32, 8, 6, "2")
    assert (vllm.dataset_name, vllm.save_result, vllm.result_dir, vllm.base_url) == (
        "random", False, None, None)


def test_only_the_random_dataset_is_accepted(capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_args("--dataset-name", "sharegpt")
    assert exit_.value.code == 2
    assert ("argument --dataset-name: only 'random' is supported (random token ids), "
            "not 'sharegpt'") in capsys.readouterr().err


@pytest.mark.parametrize("flags, loads", [
    ([], [Load(concurrency=1), Load(concurrency=8), Load(concurrency=32),
          Load(concurrency=128)]),  # neither: the default concurrencies
    (["--request-rate", "inf"], [Load(rate=math.inf)]),  # all at once, no cap
    (["--request-rate", "1,4"], [Load(rate=1.0), Load(rate=4.0)]),
    (["--max-concurrency", "2,8"], [Load(concurrency=2), Load(concurrency=8)]),
    (["--request-rate", "4", "--max-concurrency", "2"], [Load(concurrency=2, rate=4.0)]),
    (["--request-rate", "1,4", "--max-concurrency", "2"],
     [Load(concurrency=2, rate=1.0), Load(concurrency=2, rate=4.0)]),
    # uncapped Poisson loads after closed-loop ones, in one run
    (["--max-concurrency", "2,8", "--poisson-rate", "5"],
     [Load(concurrency=2), Load(concurrency=8), Load(rate=5.0)]),
    (["--poisson-rate", "5"], [Load(rate=5.0)]),
])
def test_loads_from_the_rate_and_concurrency_flags(flags, loads):
    assert parse_loads(serve_args(*flags)) == loads


def test_load_names_and_bad_loads():
    assert [lo.name for lo in (Load(concurrency=8), Load(rate=4.0), Load(rate=math.inf),
                               Load(concurrency=2, rate=0.5))] == [
        "concurrency 8", "4 req/s", "inf req/s", "0.5 req/s, concurrency 2"]
    for flags in (["--request-rate", "0"], ["--max-concurrency", "0"], ["--concurrency", ""]):
        with pytest.raises(ValueError, match="at least one --max-concurrency"):
            parse_loads(serve_args(*flags))


def most_in_flight(load: Load, num_prompts: int) -> int:
    """Runs a load against a sender that only counts how many requests overlap."""
    in_flight, peak = 0, 0

    async def send(prompt: list[int], output_len: int) -> Timing:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return Timing(start=0.0, chunk_times=[0.1], end=0.2, output_tokens=output_len)

    timings, _ = asyncio.run(run_load(send, [[1]] * num_prompts, 4, load, seed=0))
    assert len(timings) == num_prompts
    return peak


def test_a_load_splits_over_client_processes_and_a_rate_gets_eight_seconds_of_prompts():
    assert split_load(Load(concurrency=10), 4) == [Load(concurrency=c) for c in (3, 3, 2, 2)]
    assert split_load(Load(concurrency=1), 4) == [Load(concurrency=1)]  # no process idle-capped
    assert split_load(Load(rate=8.0), 4) == [Load(rate=2.0)] * 4
    assert split_load(Load(concurrency=2, rate=8.0), 4) == [Load(concurrency=1, rate=4.0)] * 2
    assert split_load(Load(rate=math.inf), 2) == [Load(rate=math.inf)] * 2
    assert [num_prompts(load, 0) for load in (Load(concurrency=2), Load(concurrency=16),
                                              Load(rate=10.0), Load(rate=1.0),
                                              Load(rate=math.inf))] == [32, 128, 80, 32, 64]
    assert num_prompts(Load(rate=10.0), 7) == 7


def test_the_cpu_meter_names_this_process_and_its_share_of_a_core():
    meter, before = CpuMeter(), cpu_seconds(os.getpid())
    deadline = time.monotonic() + 120
    # busy until this process has used 0.05 s of a core, however little a shared machine
    # lets it have a second
    while cpu_seconds(os.getpid()) - before < 0.05:
        assert time.monotonic() < deadline
        sum(range(10_000))
    used = cpu_seconds(os.getpid()) - before
    shares = meter.shares(top=1000)
    seconds = time.perf_counter() - meter.start  # a little longer than shares' own
    mine = process_name(os.getpid())
    assert mine == Path(sys.argv[0]).name or mine == Path(sys.executable).name
    # every python process of that name, summed: at least this one's share
    assert used > 0.01 and shares[mine] >= used / seconds - 0.001
    assert cpu_seconds(2**22 + 12345) is None  # above Linux's pid_max: no such process


def test_an_unbounded_rate_sends_all_at_once_and_a_cap_holds():
    assert most_in_flight(Load(rate=math.inf), 6) == 6
    assert most_in_flight(Load(concurrency=2, rate=math.inf), 6) == 2
    assert most_in_flight(Load(concurrency=2, rate=1000.0), 6) <= 2


def test_each_load_carries_vllms_keys_beside_tandems():
    async def send(prompt: list[int], output_len: int) -> Timing:
        return Timing(start=0.0, chunk_times=[0.25, 0.5], end=0.5, output_tokens=output_len)

    args = argparse.Namespace(input_len=12, output_len=2, num_requests=6, seed=0)
    results = asyncio.run(run_loads(send, args, [Load(concurrency=2, rate=math.inf)], vocab=100))
    result = results["inf req/s, concurrency 2"]
    assert (result["completed"], result["total_input_tokens"], result["total_output_tokens"],
            result["max_concurrency"], result["request_rate"]) == (6, 72, 12, 2, "inf")
    assert (result["mean_ttft_ms"], result["mean_tpot_ms"], result["mean_e2el_ms"]) == (
        250.0, 250.0, 500.0)
    assert (result["requests"], result["output_tokens"], result["ttft_s"]["p50"]) == (6, 12, 0.25)


def test_base_url_record_puts_a_single_loads_keys_at_the_top():
    args = serve_args("--base-url", "http://127.0.0.1:8000/v1/", "--num-prompts", "6")
    one = {"concurrency 2": {"completed": 6, "mean_ttft_ms": 12.5}}
    record = base_url_record(args, api_root(args.base_url), "smollm2", one)
    assert (record["base_url"], record["model_id"], record["backend"], record["num_prompts"],
            record["completed"], record["mean_ttft_ms"], record["http"]) == (
        "http://127.0.0.1:8000", "smollm2", "openai", 6, 6, 12.5, one)
    two = one | {"concurrency 8": {"completed": 6, "mean_ttft_ms": 40.0}}
    assert "completed" not in base_url_record(args, "http://h", "m", two)
    json.dumps(record, default=str)  # what publish writes


def test_an_unreachable_base_url_is_one_line_and_a_failing_code(capsys):
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1",
                 "--random-input-len", "4", "--random-output-len", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"tandem: error: --base-url http://127.0.0.1:{port}: ")
    assert err.count("\n") == 1 and "Traceback" not in err


def load_result(ttft_ms: float, tpot_ms: float, tok_s: float, cap: int | None,
                rate: float | str) -> dict:
    return {"median_ttft_ms": ttft_ms, "p99_ttft_ms": 2 * ttft_ms, "median_tpot_ms": tpot_ms,
            "p99_tpot_ms": 2 * tpot_ms, "output_throughput": tok_s, "max_concurrency": cap,
            "request_rate": rate}


def test_plot_writes_a_png(tmp_path):
    http = {"concurrency 1": load_result(10.0, 5.0, 100.0, 1, "inf"),
            "concurrency 8": load_result(30.0, 7.0, 600.0, 8, "inf")}
    in_process = {name: load_result(r["median_ttft_ms"] / 2, 4.0, 700.0, r["max_concurrency"],
                                    "inf") for name, r in http.items()}
    path = tmp_path / "serve.png"
    plots.plot_loads(str(path), {"in-process": in_process, "http": http})
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_the_plots_x_axis_is_what_the_loads_vary():
    caps = [load_result(1, 1, 1, c, "inf") for c in (1, 8)]
    rates = [load_result(1, 1, 1, None, r) for r in (1.0, "inf")]
    both = [load_result(1, 1, 1, 2, 1.0), load_result(1, 1, 1, 8, 4.0)]
    assert plots.x_axis(caps) == ("max concurrency", ["1", "8"])
    assert plots.x_axis(rates) == ("request rate (req/s)", ["1", "inf"])
    assert plots.x_axis(rates[:1]) == ("request rate (req/s)", ["1"])
    assert plots.x_axis(both) == ("request rate (req/s), max concurrency", ["1, 2", "4, 8"])
    sweep = [{"request_rate": 11.71875, "max_concurrency": None},
             {"request_rate": 5.862903, "max_concurrency": None}]
    assert plots.x_axis(sweep) == ("request rate (req/s)", ["11.7", "5.86"])


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(ValueError, match=r"--plot needs matplotlib: pip install matplotlib"):
        plots.pyplot()


def test_the_step_budget_flags_reach_the_served_engines():
    from cluster.bench.serve_bench import local_config

    args = serve_args("--model", "/models/m", "--max-num-batched-tokens", "8192",
                      "--tpot-target-ms", "25")
    config = local_config(args)
    assert (config.max_num_batched_tokens, config.tpot_target_ms) == (8192, 25.0)
    engine = config.engine_config()
    assert (engine.max_num_batched_tokens, engine.tpot_target_ms) == (8192, 25.0)


def test_the_step_shape_flags_reach_the_served_engines():
    from cluster.bench.serve_bench import local_config

    default = local_config(serve_args("--model", "/models/m")).engine_config()
    assert (default.decode_steps, default.async_scheduling) == (0, None)
    assert (replace(default, device="cpu").resolved_async_scheduling,
            replace(default, device="cuda").resolved_async_scheduling) == (False, True)
    engine = local_config(serve_args("--model", "/models/m", "--decode-steps", "1",
                                     "--no-async-scheduling")).engine_config()
    assert (engine.decode_steps, engine.async_scheduling) == (1, False)
