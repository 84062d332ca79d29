"""Developer tools: kernel sweeps and GPU checks, profilers, GPU run scripts (tools/README.md)."""
