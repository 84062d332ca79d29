"""Tiny random HuggingFace models for CPU tests, saved once per session."""

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    # larger weights than the default 0.02 give peaked logits, so greedy picks are stable
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)

SPECS = {
    "llama-tied": (LlamaConfig, dict(vocab_size=997, tie_word_embeddings=True)),
    "llama": (LlamaConfig, dict(vocab_size=1001, tie_word_embeddings=False, rope_theta=500000.0)),
    "qwen2": (Qwen2Config, dict(vocab_size=999, tie_word_embeddings=False)),
    "qwen3": (Qwen3Config, dict(vocab_size=1003, head_dim=32, tie_word_embeddings=True)),
    # eight query heads over two kv heads: tensor parallel at 4 and 8, each kv head replicated
    # on 2 and 4 ranks (see QKVParallelLinear); 517 tokens pad to 768 at TP 4 and 1024 at TP 8,
    # which leaves rank 3 and ranks 5-7 padding alone (workers/layers/embedding.py)
    "llama-8-heads": (LlamaConfig, dict(vocab_size=517, num_attention_heads=8,
                                        tie_word_embeddings=False)),
    # an unrelated draft for "llama" (speculative decoding): its vocabulary, one layer
    "llama-draft": (LlamaConfig, dict(vocab_size=1001, num_hidden_layers=1,
                                      tie_word_embeddings=False)),
}


def build_tiny_model(name: str, folder: Path) -> Path:
    config_cls, extra = SPECS[name]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder / name)
    return folder / name


# SmolLM2's tokenizer on a tiny random model of its vocabulary: text that streams (multi-byte
# characters split across tokens, leading spaces) at a tiny model's speed
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_chat_model(folder: Path, tokenizer_folder: Path) -> Path:
    config = LlamaConfig(**{**COMMON, "vocab_size": 49152, "tie_word_embeddings": True})
    torch.manual_seed(49152)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target = folder / "llama-chat"
    model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_folder / name, target / name)
    return target
