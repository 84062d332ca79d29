"""Processes: the engine (engine/), on Ray (ray/), over HTTP (serve/), the CLI (cli/) and
`tandem bench` (bench/). The offline API is importable from here."""

from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from router.sampling_params import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput",
    "SamplingParams",
]
