"""What one engine records for /metrics and the autoscaler, stepped by hand on the CPU: the
batch-size and tokens/s histograms, no GPU stats, and the autoscaler's load sample."""

from cluster import SamplingParams
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine


def test_steps_requests_and_the_load_sample(tiny_models):
    # synchronous: each step's tokens are read by the call that runs it (counts exact per step)
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", block_size=4,
                                    num_kv_blocks=32, max_num_batched_tokens=8,
                                    async_scheduling=False))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request(list(range(10, 22)), params, "a")  # 12 prompt tokens
    engine.add_request(list(range(40, 45)), params, "b")  # 5
    sample = engine.load_sample()
    assert (sample.waiting_prompt_tokens, sample.running_seqs, sample.kv_usage) == (17, 0, 0.0)
    assert sum(sample.ttft_counts) == 0
    engine.step_deltas()  # a budget of 8: 8 of a's 12 prompt tokens
    sample = engine.load_sample()
    assert (sample.waiting_prompt_tokens, sample.running_seqs) == (4 + 5, 1)
    assert sample.kv_usage == 2 / 32  # a's first 8 tokens: 2 blocks of 4
    steps = 1
    while engine.has_unfinished():
        engine.step_deltas()
        steps += 1
    snap = engine.metrics_snapshot()
    # five steps: three with both requests, two with one
    assert steps == 5
    assert snap.batch_sizes.counts[:3] == [2, 3, 0] and snap.batch_sizes.total == 8
    assert snap.request_tokens_per_second.count == 2
    assert snap.request_tokens_per_second.total > 0
    assert snap.devices == () and snap.replica is None  # the CPU has no device to read
    # vLLM's per-request histograms: a's 12 prompt tokens and b's 5, 3 generated each
    assert (snap.request_prompt_tokens.count, snap.request_prompt_tokens.total) == (2, 17)
    assert snap.request_prompt_tokens.counts[2:5] == [1, 0, 1]  # (2, 5], (5, 10], (10, 20]
    assert (snap.request_generation_tokens.count, snap.request_generation_tokens.total) == (2, 6)
    assert snap.request_prefill_time.count == snap.request_decode_time.count == 2
    assert snap.request_prefill_time.total > 0 and snap.request_decode_time.total > 0
    assert snap.cache_config == {"block_size": "4", "cache_dtype": "auto",
                                 "enable_prefix_caching": "True",
                                 "gpu_memory_utilization": "0.9", "num_gpu_blocks": "32",
                                 "num_cpu_blocks": "None"}
    assert sum(engine.load_sample().ttft_counts) == 2
    engine.shutdown()
