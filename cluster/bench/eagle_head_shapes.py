"""A random EAGLE-3 head of the published shape for a target (one decoder layer of the
target's own shape over three of its features, a draft vocabulary of 32,000 tokens: the
yuhuili / SpecForge Llama-3.1-8B head's), for measuring what drafting with a head costs while
the benchmark's oracle sets the acceptance."""

import json
from pathlib import Path

DRAFT_VOCAB = 32000  # the published Llama-3 EAGLE-3 heads'


def build_random_eagle3_head(target: Path, draft_vocab: int = DRAFT_VOCAB,
                             seed: int = 0) -> Path:
    """The head's folder beside the target's (built once)."""
    import torch
    from safetensors.torch import save_file

    from workers.speculative.eagle.head_config import default_aux_layers

    config = json.loads((Path(target) / "config.json").read_text())
    folder = Path(target).parent / f"{Path(target).name}-eagle3-random"
    if (folder / "config.json").is_file():
        return folder
    size, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or size // heads
    draft_vocab = min(draft_vocab, vocab)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * 0.02).to(
            torch.bfloat16).cpu()

    def ones() -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    tensors = {
        "fc.weight": rand(size, 3 * size),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * size),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * size),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * size),
        "midlayer.self_attn.o_proj.weight": rand(size, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, size),
        "midlayer.mlp.up_proj.weight": rand(inter, size),
        "midlayer.mlp.down_proj.weight": rand(size, inter),
        "midlayer.input_layernorm.weight": ones(),
        "midlayer.hidden_norm.weight": ones(),
        "midlayer.post_attention_layernorm.weight": ones(),
        "norm.weight": ones(),
        "lm_head.weight": rand(draft_vocab, size),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.arange(vocab) < draft_vocab,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    head_config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": size, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": config.get("rope_theta", 10000.0), "vocab_size": vocab,
        "max_position_embeddings": 2048, "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": list(default_aux_layers(
            config["num_hidden_layers"])),
    }
    (folder / "config.json").write_text(json.dumps(head_config, indent=2))  # last: built
    return folder
