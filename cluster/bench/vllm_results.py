"""vLLM's `vllm bench serve` result keys, computed from tandem's timings.

The names and the arithmetic are vLLM's (vllm/benchmarks/serve.py, `calculate_metrics`), so a
result file reads the same to vLLM's tooling and to a person holding the two side by side:

- a request completed when it streamed at least one chunk;
- TTFT: start to the first chunk; E2EL: start to the end of the stream;
- TPOT, per request of 2 or more output tokens: (E2EL - TTFT) / (output tokens - 1);
- ITL: every gap between consecutive chunks, of all requests together (a chunk may carry
  several tokens, so ITL and TPOT differ when the server batches its stream);
- each latency as mean, median, population std and p99 (numpy's linear interpolation), in ms,
  all 0 when there is nothing to measure.
"""

from __future__ import annotations

import math

import numpy as np

from cluster.bench.timing import Timing


def latency_stats(name: str, seconds: list[float]) -> dict[str, float]:
    """`mean_<name>_ms`, `median_<name>_ms`, `std_<name>_ms` and `p99_<name>_ms`."""
    values = np.asarray(seconds or [0.0]) * 1000
    return {f"mean_{name}_ms": float(np.mean(values)),
            f"median_{name}_ms": float(np.median(values)),
            f"std_{name}_ms": float(np.std(values)),
            f"p99_{name}_ms": float(np.percentile(values, 99))}


def vllm_metrics(timings: list[Timing], duration: float, input_lens: list[int]) -> dict:
    """One load's vLLM keys: `timings[i]` is the request whose prompt had `input_lens[i]`
    tokens; `duration` is the load's wall time in seconds, first send to last end."""
    completed = [(t, n) for t, n in zip(timings, input_lens, strict=True) if t.chunk_times]
    finished = [t for t, _ in completed]
    total_input = sum(n for _, n in completed)
    total_output = sum(t.output_tokens for t in finished)
    return {
        "duration": duration, "completed": len(finished),
        "failed": len(timings) - len(finished),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(finished) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        **latency_stats("ttft", [t.ttft for t in finished]),
        **latency_stats("tpot", [t.tpot for t in finished if t.tpot is not None]),
        **latency_stats("itl", [gap for t in finished for gap in t.itls]),
        **latency_stats("e2el", [t.end - t.start for t in finished]),
    }


def traffic_keys(max_concurrency: int | None, request_rate: float | None) -> dict:
    """How the load was offered, as vLLM records it: an unbounded rate is the string "inf"
    (JSON has no infinity), no concurrency cap is null."""
    unbounded = request_rate is None or math.isinf(request_rate)
    return {"max_concurrency": max_concurrency,
            "request_rate": "inf" if unbounded else request_rate}


def result_file_name(label: str, loads: list[dict], model: str, stamp: str) -> str:
    """vLLM's `<label>-<rate>qps[-concurrency<c>]-<model>-<time>.json`; several loads join
    their distinct rates and caps with '_'."""
    rates = "_".join(dict.fromkeys(str(load["request_rate"]) for load in loads))
    caps = [str(load["max_concurrency"]) for load in loads if load["max_concurrency"]]
    concurrency = f"-concurrency{'_'.join(dict.fromkeys(caps))}" if caps else ""
    return f"{label}-{rates}qps{concurrency}-{model.rstrip('/').split('/')[-1]}-{stamp}.json"
