"""Processes: the engine (engine/), on Ray (ray/), over HTTP (serve/), the CLI (cli/) and
`tandem bench` (bench/). The offline API is importable from here.

Its names are imported on first use: a process that only routes or monitors (the router and
monitor actors import ``cluster.ray``) then never loads torch and transformers, ~3 s of CPU
for each such actor."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.engine.config import EngineConfig
    from cluster.engine.llm import LLM
    from cluster.engine.llm_engine import LLMEngine
    from cluster.engine.outputs import CompletionOutput, EngineStats, RequestOutput
    from router.sampling_params import SamplingParams

_HOMES = {
    "EngineConfig": "cluster.engine.config", "LLM": "cluster.engine.llm",
    "LLMEngine": "cluster.engine.llm_engine", "CompletionOutput": "cluster.engine.outputs",
    "EngineStats": "cluster.engine.outputs", "RequestOutput": "cluster.engine.outputs",
    "SamplingParams": "router.sampling_params",
}

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
