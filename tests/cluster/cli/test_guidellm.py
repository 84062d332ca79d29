"""A third-party load generator, guidellm, runs unchanged against `tandem serve`: a small bounded
benchmark of synthetic prompts, then exact checks of the JSON report it writes."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import environment
from tests.cluster.cli.conftest import SERVED_MODEL
from tests.metrics_scrape import scrape
from workers.catalog import model_dir

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NUM_REQUESTS = 6
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 8
# requests the server finished at their max_tokens, over all its replicas
FINISHED_BY_LENGTH = "tandem:request_success_total{finished_reason=length}"


def run_guidellm(url: str, request_format: str, profile: str, report: Path) -> dict:
    """Runs `guidellm run` and returns its one benchmark from the JSON report."""
    # a dev dependency: missing, it fails here rather than skipping
    assert importlib.util.find_spec("guidellm"), "guidellm missing: pip install -e '.[dev]'"
    # the served model's own folder is the tokenizer that builds the prompts: no hub
    tokenizer = model_dir(SERVED_MODEL, environment.cache_dir())
    command = [sys.executable, "-m", "guidellm", "run",
               "--backend", f"kind=openai_http,target={url},model={SERVED_MODEL},"
                            f"request_format={request_format}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                         f"output_tokens={OUTPUT_TOKENS}",
               "--profile", profile,
               "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
               "--output", f"kind=json,path={report}",
               "--disable-console-interactive"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(command, env=env, cwd=report.parent, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    return benchmark


@pytest.mark.parametrize(("request_format", "profile"), [
    ("/v1/chat/completions", "kind=synchronous"),
    ("/v1/completions", "kind=concurrent,streams=3"),
])
def test_guidellm_benchmark_reports_every_request_complete(served_url, tmp_path, request_format,
                                                            profile):
    before = scrape(served_url)[FINISHED_BY_LENGTH]
    benchmark = run_guidellm(served_url, request_format, profile, tmp_path / "report.json")
    # guidellm's scheduler made every request, and the server finished each of them
    scheduled = benchmark["scheduler_state"]
    kinds = ("created", "processed", "successful", "errored", "cancelled")
    assert [scheduled[f"{kind}_requests"] for kind in kinds] == [NUM_REQUESTS] * 3 + [0, 0]
    assert scrape(served_url)[FINISHED_BY_LENGTH] - before == NUM_REQUESTS
    metrics = benchmark["metrics"]
    # its report may leave out the last one, whose completion it can take as past the end
    # of measurement on a busy machine (guidellm's accounting: seen in a full-suite run)
    counted = metrics["request_totals"]["total"]
    assert counted in (NUM_REQUESTS - 1, NUM_REQUESTS)
    assert metrics["request_totals"] == {"successful": counted, "errored": 0,
                                         "incomplete": 0, "total": counted}
    requests = benchmark["requests"]["successful"]
    assert len(requests) == counted
    # guidellm sends ignore_eos, so every request generates exactly its output length
    assert [request["output_tokens"] for request in requests] == [OUTPUT_TOKENS] * counted
    prompt_tokens = {request["prompt_tokens"] for request in requests}
    if request_format == "/v1/completions":
        # the server's usage counts the prompt as guidellm's tokenizer built it
        assert prompt_tokens == {PROMPT_TOKENS}
    else:  # the chat template adds the same tokens to every prompt
        (chat_prompt_tokens,) = prompt_tokens
        assert chat_prompt_tokens > PROMPT_TOKENS
    for request in requests:
        # streamed: the first token arrives before the response ends
        assert 0 < request["time_to_first_token_ms"] / 1000 < request["request_latency"]
        assert request["inter_token_latency_ms"] > 0
    for name in ("request_latency", "time_to_first_token_ms", "inter_token_latency_ms"):
        successful = metrics[name]["successful"]
        assert successful["count"] > 0 and successful["min"] > 0, name
    assert metrics["time_to_first_token_ms"]["successful"]["count"] == counted
    assert metrics["output_token_count"]["successful"]["total_sum"] == counted * OUTPUT_TOKENS
