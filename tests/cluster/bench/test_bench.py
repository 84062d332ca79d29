"""`tandem bench`: the workload generators, the roofline arithmetic, a tiny end-to-end run."""

import json

import pytest

from cluster.bench import hf_baseline, roofline, shapes, workloads
from cluster.cli.main import main


def test_w2_is_the_nano_vllm_workload():
    requests = workloads.throughput_requests()
    assert len(requests) == 256
    assert workloads.total_prompt_tokens(requests) == 142_827
    assert workloads.total_output_tokens(requests) == 133_966
    first = workloads.throughput_requests(num_requests=32)
    assert first == requests[:32]


def test_w4_and_its_ideal_hit_rate():
    requests = workloads.prefix_requests(num_groups=2, group_size=3, prefix_len=32,
                                         question_len=8, max_tokens=4)
    assert len(requests) == 6 and all(len(r.prompt_token_ids) == 40 for r in requests)
    assert requests[0].prompt_token_ids[:32] == requests[2].prompt_token_ids[:32]
    assert requests[0].prompt_token_ids[:32] != requests[3].prompt_token_ids[:32]
    rate = workloads.ideal_prefix_hit_rate(64, 16, 2048, 128, 16)
    assert rate == pytest.approx(15 * 2048 / (16 * 2176)) and round(rate, 3) == 0.882


def test_shapes_have_the_published_sizes():
    params = {name: shapes.num_parameters(cfg) for name, cfg in shapes.SHAPES.items()}
    assert params["llama-3.2-1b"] == 1_235_814_400
    assert params["qwen3-0.6b"] == 596_049_920
    assert params["llama-3.1-8b"] == 8_030_261_248


def test_roofline_arithmetic():
    ceilings = roofline.Ceilings(4.3e12, 786e12, "bfloat16")
    cost = roofline.ModelCost(weight_bytes=2_471_628_800, kv_bytes_per_token=32768,
                              num_params=1_235_814_400)
    at_zero = roofline.latency_bound(cost, 0, 1, ceilings)["tokens_per_s"]
    assert at_zero == pytest.approx(4.3e12 / 2_471_628_800) and round(at_zero) == 1740
    # two requests (prompt 10, output 3) and (prompt 4, output 1): 3 steps, KV read at
    # contexts 10, 11, 12 and 4, KV written for all 18 tokens
    bound = roofline.workload_bound(cost, [10, 4], [3, 1], ceilings)
    expected_bytes = 3 * cost.weight_bytes + (10 + 11 + 12 + 4 + 18) * 32768
    assert bound["bytes"] == expected_bytes
    assert bound["seconds"] == pytest.approx(max(expected_bytes / 4.3e12,
                                                 2 * cost.num_params * 18 / 786e12))
    assert bound["output_tokens_per_s"] == pytest.approx(4 / bound["seconds"])


@pytest.mark.parametrize("hf_cap, hf_work", [
    (["--hf-max-new-tokens", "8"], "<= 8 new"),  # capped at 8 of the requests' 8-16 tokens
    ([], "their own output lengths"),  # the default: HF does the same work as tandem
])
def test_tiny_throughput_run_writes_every_figure(tiny_models, tmp_path, capsys, hf_cap, hf_work):
    output = tmp_path / "w2.json"
    code = main(["bench", "throughput", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--num-requests", "4", "--min-len", "8", "--max-len", "16",
                 "--hf-batch-sizes", "2,4", *hf_cap,
                 "--hf-batch-requests", "0", "--cpu-kv-cache-gb", "0.05",
                 "--output", str(output)])
    assert code == 0
    record = json.loads(output.read_text())
    assert {"config", "environment", "ceilings", "model_cost", "tandem", "hf_generate",
            "roofline", "summary", "table", "workload"} <= set(record)
    assert record["environment"]["torch"] and "transformers" in record["environment"]
    assert record["ceilings"]["bandwidth_bytes_per_s"] > 0
    tandem = record["tandem"]
    requests = workloads.throughput_requests(4, 8, 16, vocab_size=10001)
    assert tandem["output_tokens"] == workloads.total_output_tokens(requests)
    assert tandem["prompt_tokens"] == workloads.total_prompt_tokens(requests)
    assert {"p50", "p99"} <= set(tandem["ttft_s"])
    assert record["hf_generate"]["best"]["output_tokens_per_s"] > 0
    assert record["summary"]["speedup_vs_best_hf"] > 0
    out = capsys.readouterr().out
    assert "| tandem |" in out
    # the table says whether HF did the requests' own work (the best batch size: 2 or 4)
    best = record["hf_generate"]["best"]
    batch = requests[: best["batch_size"]]
    assert f"(first {len(batch)} requests, {hf_work}) |" in out
    if not hf_cap:
        assert best["useful_output_tokens"] == sum(r.max_tokens for r in batch)
        assert best["new_tokens"] == max(r.max_tokens for r in batch)


def test_hf_label_says_whether_it_did_the_requests_own_work():
    run = {"batch_size": 256, "new_tokens": 1024, "capped": False}
    assert hf_baseline.generate_label(run) == (
        "HF generate() batch 256 (first 256 requests, their own output lengths)")
    assert hf_baseline.generate_label(run | {"new_tokens": 256, "capped": True}) == (
        "HF generate() batch 256 (first 256 requests, <= 256 new)")


def test_serve_bench_reads_chunk_times_and_usage_from_raw_events():
    from cluster.bench.serve_load import Timing, read_event

    timing = Timing(start=0.0)
    events = [b'data: {"id":"c","choices":[{"index":0,"text":"Hi"}]}',
              b'data: {"id":"c","choices":[{"index":0,"text":""}]}',  # a token without text
              b'data: {"id":"c","choices":[{"index":0,"text":"!","finish_reason":"length"}]}',
              b'data: {"id":"c","choices":[{"index":0,"text":"","finish_reason":"stop"}]}',
              b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,'
              b'"completion_tokens":4,"total_tokens":7}}',
              b"data: [DONE]"]
    for now, item in enumerate(events, start=1):
        read_event(item, float(now), timing)
    assert timing.chunk_times == [1.0, 2.0, 3.0] and timing.output_tokens == 4


def test_serve_bench_warms_each_load_up_before_measuring_it():
    """A short run of each load first (its batch shapes compile there), then 8 x concurrency
    measured requests; only the measured ones are summarized."""
    import argparse
    import asyncio

    from cluster.bench.serve_load import Load, Timing, run_loads

    sent: list[tuple[int, int]] = []

    async def send(prompt: list[int], output_len: int) -> Timing:
        sent.append((len(prompt), output_len))
        return Timing(start=0.0, chunk_times=[0.1], end=0.2, output_tokens=output_len)

    args = argparse.Namespace(input_len=12, output_len=64, num_requests=0, seed=0)
    results = asyncio.run(run_loads(send, args, [Load(concurrency=2), Load(concurrency=5)],
                                    vocab=100))
    assert sent == ([(12, 16)] * 2 + [(12, 64)] * 32 +  # concurrency 2: at least 32 measured
                    [(12, 16)] * 5 + [(12, 64)] * 40)  # concurrency 5: 8 x 5
    assert [r["requests"] for r in results.values()] == [32, 40]
    assert results["concurrency 5"]["output_tokens"] == 40 * 64
