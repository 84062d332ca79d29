"""Processes: the engine, its executors, the offline API, the server and the CLI."""

from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from router.sampling_params import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput",
    "SamplingParams",
]
