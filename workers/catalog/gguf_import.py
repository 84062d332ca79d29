"""Convert a llama.cpp GGUF file into a HuggingFace folder (float32 safetensors + config).

Our own converter, so the import needs neither accelerate nor transformers' model-from-gguf
path. Only the tokenizer is converted by transformers (its GGUF tokenizer conversion is exact).

Two llama.cpp conventions are undone here:
- GGUF lists dims fastest-first (`[in, out]`); `GGUFReader`'s numpy views are already row-major
  `(out, in)`, the torch layout, once dequantized.
- convert_hf_to_gguf permutes the rows of Llama's q_proj/k_proj so rotary pairs are adjacent
  (GPT-J style); HF rotates halves (NeoX style). Qwen2 is exported unpermuted.
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Architectures whose q/k rows convert_hf_to_gguf permuted for GPT-J-style rotary.
_ROTARY_PERMUTED = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp name -> HF name: blk.3.attn_q.bias -> model.layers.3.self_attn.q_proj.bias."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute`: per head, rows (dim/2, 2) -> (2, dim/2)."""
    head_rows = weight.shape[0] // num_heads
    # (heads, head_dim/2, 2, ...) -> (heads, 2, head_dim/2, ...)
    per_head = weight.reshape(num_heads, head_rows // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def read_field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def build_config(reader: gguf.GGUFReader, vocab_size: int, has_lm_head: bool) -> dict:
    arch = read_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (known: {sorted(ARCHITECTURES)})")
    if reader.get_field(f"{arch}.rope.scaling.type") is not None:
        raise ValueError("GGUF rope scaling is not supported by the importer")
    hidden_size = read_field(reader, f"{arch}.embedding_length")
    num_heads = read_field(reader, f"{arch}.attention.head_count")
    # GGUF stores float32; print-round so 1e-5 is not 9.999999747378752e-06.
    rms_norm_eps = float(f"{read_field(reader, f'{arch}.attention.layer_norm_rms_epsilon'):.6g}")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": read_field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": read_field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": read_field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": read_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": float(read_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": read_field(reader, f"{arch}.context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": read_field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    return config


def dequantized_tensors(
    reader: gguf.GGUFReader, config: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file, q/k un-permuted where needed."""
    permuted = config["model_type"] in _ROTARY_PERMUTED
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in tqdm(reader.tensors, desc="convert", unit="tensor"):
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        if permuted and part in heads:
            weight = unpermute_rotary(weight, heads[part])
        yield hf_tensor_name(tensor.name), torch.from_numpy(np.ascontiguousarray(weight))


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files."""
    reader = gguf.GGUFReader(gguf_path)
    names = {tensor.name for tensor in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = int(embedding.shape[-1])  # GGUF order: [hidden, vocab]
    config = build_config(reader, vocab_size, has_lm_head="output.weight" in names)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(dict(dequantized_tensors(reader, config)), out_dir / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    _write_json(out_dir / "config.json", config)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id")}
    _write_json(out_dir / "generation_config.json", generation)
    save_tokenizer(reader, gguf_path, out_dir, config["eos_token_id"])
    return config


def save_tokenizer(reader: gguf.GGUFReader, gguf_path: Path, out_dir: Path, eos_id: int) -> None:
    """transformers' GGUF tokenizer conversion, checked for the chat template and eos."""
    from transformers import AutoTokenizer  # heavy; only needed here

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    template = read_field(reader, "tokenizer.chat_template")
    if template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = template
    eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    if tokenizer.eos_token != eos_token:
        tokenizer.eos_token = eos_token
    tokenizer.save_pretrained(out_dir)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
