"""Service-level objectives of `tandem bench serve`: goodput, and the highest Poisson rate a
server keeps within an SLO.

Two spellings, both vLLM's ``KEY:MILLISECONDS`` pairs (keys ``ttft``, ``tpot``, ``e2el``):

- ``--goodput ttft:200 tpot:20``: a request is good when each of its own figures is below
  its limit; goodput is good requests a second (vLLM's ``request_goodput``).
- ``--slo ttft:500 tpot:25``: a load meets it when the 90th percentile of each figure over
  its requests is below the limit; ``--find-slo-rate`` looks for the highest Poisson rate
  that does (``find_slo_rate``).
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cluster.bench.timing import Timing

KEYS = ("ttft", "tpot", "e2el")
DEFAULT_GOODPUT = ("ttft:200", "tpot:20")
DEFAULT_SLO = ("ttft:500", "tpot:25")
SLO_PERCENTILE = 90


@dataclass(frozen=True)
class Slo:
    """Limits in seconds; None: not limited."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None

    @property
    def text(self) -> str:
        """As the flag spells it: 'ttft:200 tpot:20' (milliseconds)."""
        return " ".join(f"{key}:{limit * 1e3:g}" for key, limit in self.limits())

    def limits(self) -> list[tuple[str, float]]:
        values = (self.ttft_s, self.tpot_s, self.e2el_s)
        return [(key, value) for key, value in zip(KEYS, values, strict=True)
                if value is not None]

    def good(self, timing: Timing) -> bool:
        """One finished request within every limit (a one-token answer has no TPOT)."""
        figures = request_figures(timing)
        return all(figures[key] is None or figures[key] < limit  # type: ignore[operator]
                   for key, limit in self.limits())


def parse_slo(pairs: list[str] | tuple[str, ...], flag: str) -> Slo:
    """'ttft:200' 'tpot:20' -> Slo; ValueError naming the flag and the pair that is wrong."""
    limits: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition(":")
        if not sep or key not in KEYS:
            raise ValueError(f"{flag} {pair!r}: give KEY:MILLISECONDS with KEY one of "
                             f"{', '.join(KEYS)}")
        try:
            milliseconds = float(value)
        except ValueError:
            raise ValueError(f"{flag} {pair!r}: {value!r} is not a number of "
                             "milliseconds") from None
        if not milliseconds > 0:
            raise ValueError(f"{flag} {pair!r}: the limit must be above 0 ms")
        if key in limits:
            raise ValueError(f"{flag}: {key} is given twice")
        limits[key] = milliseconds / 1e3
    if not limits:
        raise ValueError(f"{flag}: give at least one KEY:MILLISECONDS")
    return Slo(**{f"{key}_s": value for key, value in limits.items()})


def request_figures(timing: Timing) -> dict[str, float | None]:
    return {"ttft": timing.ttft, "tpot": timing.tpot, "e2el": timing.end - timing.start}


def goodput(timings: list[Timing], seconds: float, slo: Slo) -> float:
    """Finished requests within ``slo``, a second."""
    return sum(1 for t in timings if t.chunk_times and slo.good(t)) / seconds


SUMMARY_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}  # tandem_summary's


def load_meets(result: dict, slo: Slo) -> bool:
    """Whether a load's summary (``tandem_summary``) meets ``slo`` at its 90th percentiles;
    a load in which a request produced nothing does not."""
    if result["finished"] < result["requests"]:
        return False
    p90s = [(result[SUMMARY_KEYS[key]]["p90"], limit) for key, limit in slo.limits()]
    return all(p90 is not None and p90 < limit for p90, limit in p90s)


Probe = Callable[[float], Awaitable[dict]]  # a Poisson rate -> that load's summary


async def find_slo_rate(probe: Probe, slo: Slo, start: float, refinements: int = 3,
                        max_probes: int = 12) -> dict:
    """The highest Poisson rate whose load meets ``slo``: from ``start`` the rate doubles
    while the load meets it (or halves until one does), then ``refinements`` bisections
    between the last rate that met it and the first that did not. Every probe is kept, in
    the order run; ``rate`` is None when none met it within ``max_probes``."""
    if not start > 0:
        raise ValueError(f"the sweep's first rate must be above 0, not {start}")
    probes: list[dict] = []

    async def run(rate: float) -> bool:
        result = await probe(rate)
        met = load_meets(result, slo)
        probes.append({"rate": rate, "meets": met, "result": result})
        return met

    good, bad, rate = None, None, start
    while len(probes) < max_probes and (good is None or bad is None):
        if await run(rate):
            good, rate = rate, rate * 2
        else:
            bad, rate = rate, rate / 2
    for _ in range(refinements):
        if good is None or bad is None or len(probes) >= max_probes:
            break
        middle = (good + bad) / 2
        if await run(middle):
            good = middle
        else:
            bad = middle
    return {"slo": slo.text, "percentile": SLO_PERCENTILE, "rate": good,
            "first_rate_missed": bad, "probes": probes}
