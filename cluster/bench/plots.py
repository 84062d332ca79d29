"""`tandem bench serve --plot FILE.png`: TTFT, TPOT and output throughput of each load.

One panel a figure, one line a path (in-process, http), the loads along the x axis in the order
they ran, labelled by what they vary: the concurrency cap or the request rate. The axis is
categorical, so an unbounded rate ("inf") and rates far apart both have a place.
"""

PANELS = (("TTFT (ms)", (("p50", "median_ttft_ms"), ("p99", "p99_ttft_ms"))),
          ("TPOT (ms)", (("p50", "median_tpot_ms"), ("p99", "p99_tpot_ms"))),
          ("output throughput (tok/s)", (("", "output_throughput"),)))


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib's pyplot on the Agg backend (files only, no display), or a clear error."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def x_axis(loads: list[dict]) -> tuple[str, list[str]]:
    """The axis title and one tick label a load: whichever of rate and cap the loads vary."""
    rates = [rate_label(load["request_rate"]) for load in loads]
    caps = [str(load["max_concurrency"]) for load in loads]
    rates_vary, caps_vary = len(set(rates)) > 1, len(set(caps)) > 1
    if rates_vary and caps_vary:
        return "request rate (req/s), max concurrency", [
            f"{rate}, {cap}" for rate, cap in zip(rates, caps, strict=True)]
    if rates_vary or (not caps_vary and caps[0] == "None"):
        return "request rate (req/s)", rates
    return "max concurrency", caps


def rate_label(rate: float | str) -> str:
    """'inf' as it is, a rate in 3 significant digits (a sweep's bisections make long ones)."""
    return rate if isinstance(rate, str) else f"{rate:.3g}"


def plot_loads(path: str, series: dict[str, dict[str, dict]]) -> None:
    """Writes the figure to `path`. `series` maps a path's label to its loads' vLLM results,
    keyed by load name; every path ran the same loads."""
    plt = pyplot()
    loads = list(next(iter(series.values())).values())
    title, ticks = x_axis(loads)
    positions = list(range(len(ticks)))
    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for axis, (ylabel, lines) in zip(axes, PANELS, strict=True):
        for label, results in series.items():
            for stat, key in lines:
                values = [result[key] for result in results.values()]
                axis.plot(positions, values, marker="o", label=f"{label} {stat}".strip())
        axis.set(xlabel=title, ylabel=ylabel, xticks=positions, xticklabels=ticks)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
