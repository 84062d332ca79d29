"""Models of real architectures with random weights: config.json + safetensors files.

Speed does not depend on weight values, so a shape stands in for the real checkpoint. No
tokenizer is written: prompts are token ids. Folders are cached by shape and dtype. A model
over SHARD_BYTES is written in files of at most that (with HF's index), one file at a time, so
building the 70B shape (141 GB) never holds more than one file in memory.
"""

import json
import math
from pathlib import Path

LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0)),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=8.0)),
    # the brief's 8 x A100 comparison (vLLM, SGLang, TGI, TensorRT-LLM): TP 4 and 8 (W7)
    "llama-3-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
    # the speculative pair of the catalog (W5): one tokenizer, q/k/v with biases
    "qwen2.5-coder-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0),
    "qwen2.5-coder-1.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536,
        intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0),
}
SHARD_BYTES = 4 << 30
COMMON = dict(hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=0,
              eos_token_id=1, torch_dtype="bfloat16")


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF checkpoint names and shapes of a Llama-family decoder."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden),
              "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if config["model_type"] == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": (q_size,),
                       p + "self_attn.k_proj.bias": (kv_size,),
                       p + "self_attn.v_proj.bias": (kv_size,)}
        if config["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,),
                       p + "self_attn.k_norm.weight": (head_dim,)}
    return shapes


def num_parameters(config: dict) -> int:
    total = 0
    for shape in parameter_shapes(config).values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


def build_random_model(shape: str, root: Path, config_overrides: dict | None = None,
                       seed: int = 0) -> Path:
    """The folder of `shape` with random bf16 weights (std 0.02, norms 1, biases 0), built
    once; another ``seed`` is another model of the same shape (its own folder)."""
    import torch
    from safetensors.torch import save_file

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (choose from {', '.join(SHAPES)})")
    config = {**SHAPES[shape], **COMMON, **(config_overrides or {})}
    suffix = "" if not config_overrides else "-" + "-".join(
        f"{k}{v}" for k, v in sorted(config_overrides.items()))
    folder = Path(root) / f"{shape}{suffix}-random{'' if seed == 0 else f'-seed{seed}'}"
    if is_built(folder):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    files = shard_files(parameter_shapes(config), SHARD_BYTES)
    shapes = parameter_shapes(config)
    for file, names in files.items():  # in parameter order: one seed, the same tensors
        tensors = {name: random_tensor(name, shapes[name], gen, device) for name in names}
        save_file(tensors, str(folder / f"{file}.tmp"), metadata={"format": "pt"})
        (folder / f"{file}.tmp").rename(folder / file)
    if len(files) > 1:
        weight_map = {name: file for file, names in files.items() for name in names}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))  # last: it is built
    return folder


def is_built(folder: Path) -> bool:
    weights = (folder / "model.safetensors").is_file() or (
        folder / "model.safetensors.index.json").is_file()
    return weights and (folder / "config.json").is_file()


def random_tensor(name: str, size: tuple[int, ...], gen, device: str):
    """bf16: biases 0, norm weights 1, matrices N(0, 0.02)."""
    import torch

    if name.endswith(".bias"):
        return torch.zeros(size, dtype=torch.bfloat16)
    if len(size) == 1:  # norm weights
        return torch.ones(size, dtype=torch.bfloat16)
    weight = torch.randn(size, generator=gen, device=device, dtype=torch.bfloat16)
    return weight.mul_(0.02).cpu()


def shard_files(shapes: dict[str, tuple[int, ...]], max_bytes: int) -> dict[str, list[str]]:
    """File name -> the parameters it holds, in order, each file at most max_bytes of bf16
    (a tensor larger alone gets a file of its own); one file: model.safetensors."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}
