"""`tandem bench`: tandem, the HuggingFace baseline and the roofline, measured in one run.

shapes (random-weight models of real architectures), workloads (W1, W2, W4 of
../shared/BENCHMARKS.md), roofline (measured ceilings and bounds), hf_baseline, engine_runs
(tandem's side), report (table and JSON), commands (one function per workload), args (CLI).
"""
