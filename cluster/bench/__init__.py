"""`tandem bench`: tandem, the HuggingFace baseline and the roofline, measured in one run.

shapes (random-weight models of real architectures), workloads (W1-W4 requests), roofline
(measured ceilings and bounds), hf_baseline, engine_runs (tandem's side), report (table and
JSON), commands (W1, W2, W4), prefix_replicas (W4 on replicas), serve_bench and serve_load
(W3, with vllm_results for vLLM's result keys and plots), speculative (W5), tp_scaling (W7),
args (the CLI's parsers).
"""
