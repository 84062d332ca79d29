"""Random EAGLE heads in each published layout (workers/speculative/eagle/), for a target of
hidden size 64 with 4 attention heads over 2 KV heads: the tiny test models' shape."""

import json

import torch
from safetensors.torch import save_file

H, HEADS, KV_HEADS, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 96, 101, 16


def layer(vocab: int) -> dict:
    return dict(hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=vocab,
                rope_theta=10000.0, max_position_embeddings=64, rms_norm_eps=1e-6)


def random_layer(prefix: str, q_in: int, generator: torch.Generator,
                 input_norm: bool, hidden_norm: bool) -> dict[str, torch.Tensor]:
    head_dim = H // HEADS

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    tensors = {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * head_dim, q_in),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * head_dim, q_in),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * head_dim, q_in),
        f"{prefix}self_attn.o_proj.weight": rand(H, HEADS * head_dim),
        f"{prefix}mlp.gate_proj.weight": rand(INTER, H),
        f"{prefix}mlp.up_proj.weight": rand(INTER, H),
        f"{prefix}mlp.down_proj.weight": rand(H, INTER),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(H),
    }
    if input_norm:
        tensors[f"{prefix}input_layernorm.weight"] = 1 + rand(H)
    if hidden_norm:
        tensors[f"{prefix}hidden_norm.weight"] = 1 + rand(H)
    return tensors


def write_head(folder, layout: str, fc_bias: bool = False, bin_file: bool = False,
               norm_before_residual: bool = False, config_extra: dict | None = None,
               vocab: int = VOCAB):
    """A random head in ``layout`` for a target of hidden size H and ``vocab`` tokens;
    returns its tensors by their checkpoint names."""
    generator = torch.Generator().manual_seed(hash(layout) % 1000)
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "eagle1":
        tensors = random_layer("layers.0.", H, generator, input_norm=False, hidden_norm=False)
        tensors["fc.weight"] = torch.randn(H, 2 * H, generator=generator) * 0.2
        tensors["embed_tokens.weight"] = torch.randn(vocab, H, generator=generator)
        config = dict(layer(vocab), architectures=["LlamaForCausalLM"], bias=fc_bias)
    else:
        prefix = "midlayer." if layout == "eagle3" else "layers.0."
        tensors = random_layer(prefix, 2 * H, generator, input_norm=True, hidden_norm=True)
        tensors["fc.weight"] = torch.randn(H, 3 * H, generator=generator) * 0.1
        tensors["norm.weight"] = 1 + torch.randn(H, generator=generator) * 0.2
        tensors["lm_head.weight"] = torch.randn(DRAFT_VOCAB, H, generator=generator)
        draft_ids = torch.randperm(vocab, generator=generator)[:DRAFT_VOCAB].sort().values
        tensors["d2t"] = draft_ids - torch.arange(DRAFT_VOCAB)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True)
        if layout == "eagle3":
            config = dict(layer(vocab), architectures=["LlamaForCausalLMEagle3"],
                          draft_vocab_size=DRAFT_VOCAB)
        else:
            config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                      "transformer_layer_config": layer(vocab), "draft_vocab_size": DRAFT_VOCAB,
                      "norm_before_residual": norm_before_residual,
                      "target_hidden_size": H}
    if fc_bias:
        tensors["fc.bias"] = torch.randn(H, generator=generator) * 0.1
    config.update(config_extra or {})
    (folder / "config.json").write_text(json.dumps(config))
    if bin_file:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return tensors
