"""`tandem bench serve --base-url` against a running `tandem serve`, with vLLM's command line:
nothing starts on the client side, the result file has vLLM's keys, the plot is a PNG."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 32, 8


def test_vllm_style_bench_of_a_running_server(served_url, tmp_path):
    plot = tmp_path / "serve.png"
    command = [sys.executable, "-m", "cluster.cli.main", "bench", "serve",
               "--base-url", served_url, "--dataset-name", "random",
               "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
               "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "2",
               "--save-result", "--result-dir", str(tmp_path), "--plot", str(plot)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    [path] = tmp_path.glob("openai-infqps-concurrency2-smollm2-135m-instruct-*.json")
    result = json.loads(path.read_text())
    assert (result["completed"], result["failed"], result["max_concurrency"],
            result["request_rate"]) == (NUM_PROMPTS, 0, 2, "inf")
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos honoured
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
                "mean_e2el_ms", "duration", "request_throughput", "output_throughput",
                "total_token_throughput"):
        assert result[key] > 0, key
    assert list(result["http"]) == ["concurrency 2"]  # the one load, also keyed by its name
    assert result["http"]["concurrency 2"]["goodput_requests_per_s"] >= 0  # tandem's extras
    assert plot.read_bytes()[:4] == b"\x89PNG"
