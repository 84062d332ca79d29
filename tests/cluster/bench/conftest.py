"""The bench commands measure this machine's ceilings (a 256 MiB copy and a 1024^3 matmul, ten
times each: ~2 s of both cores here) before every run. The machine is the same all session:
the first run measures them for real, the later ones reuse that measurement."""

import functools

import pytest

from cluster.bench import roofline

measure_ceilings_once = functools.cache(roofline.measure_ceilings)


@pytest.fixture(autouse=True)
def ceilings_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roofline, "measure_ceilings", measure_ceilings_once)
