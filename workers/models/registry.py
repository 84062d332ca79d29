"""Which model class runs a checkpoint, chosen by ``config.architectures[0]``."""

from torch import nn
from transformers import PretrainedConfig

from workers.models.llama import LlamaForCausalLM

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
