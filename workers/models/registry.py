"""Which model class runs a checkpoint, chosen by ``config.architectures[0]``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from workers.models.llama import LlamaForCausalLM

if TYPE_CHECKING:  # transformers is imported where a config is read, not to run a shard
    from transformers import PretrainedConfig

# the four families share one decoder; DecoderFlavor.of(config) picks their differences
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class_for(config: PretrainedConfig) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or ["<none>"]
    architecture = architectures[0]
    if architecture not in MODEL_CLASSES:
        supported = ", ".join(MODEL_CLASSES)
        raise ValueError(f"unsupported architecture '{architecture}' (supported: {supported})")
    return MODEL_CLASSES[architecture]
