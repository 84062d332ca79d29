"""Processes: the engine, its executors, the offline API, the server and the CLI."""

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.llm import LLM
from cluster.outputs import CompletionOutput, EngineStats, RequestOutput
from router.sampling_params import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput",
    "SamplingParams",
]
