"""Triton kernel sweeps, micro-benchmarks and checks (tools/README.md)."""
