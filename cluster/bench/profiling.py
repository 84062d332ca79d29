"""Where a decode step's time goes: the GPU time of one graph replay, and a torch.profiler
table of a few engine steps (GPU only)."""

import torch

from cluster.bench.roofline import median_seconds


def graph_replay_seconds(llm, batch_size: int = 1) -> float | None:
    """Median time of replaying the captured decode graph alone: the step's GPU floor."""
    worker = getattr(llm.engine.executor, "worker", None)
    graphs = getattr(worker, "graphs", None)
    if graphs is None or batch_size not in graphs.graphs:
        return None
    graph = graphs.graphs[batch_size]
    return median_seconds(graph.replay, graphs.device, repeats=50)


def profile_steps(fn) -> str:
    """torch.profiler's table of the kernels and ops run by fn, by total device time."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                     max_name_column_width=60)
