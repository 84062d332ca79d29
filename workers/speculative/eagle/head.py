"""An EAGLE head: one decoder layer (or a few) that predicts the target's next hidden state
from its current one and the next token, over its own paged KV cache.

Position i of a sequence feeds the head (token i + 1, the target's feature at i), at the
rotary position i; the head's output there predicts the feature at i + 1, whose logits give
the token at i + 2. Chained, each step feeds back the head's own output as the feature.

EAGLE-1 (``method="eagle"``): ``fc(concat(embed, feature))``, the layer without an input
norm, output ``hidden + residual`` with no norm, logits by the target's lm_head. EAGLE-3:
``fc`` maps the three target features (3 H) to H once, the first layer attends over
``concat(input_norm(embed), hidden_norm(feature))`` (2 H wide) with the feature (or, with
``norm_before_residual``, its norm) as the residual, a final ``norm`` before its own lm_head
over a reduced vocabulary (draft id i is target id ``i + d2t[i]``), and the pre-norm sum fed
back as the next step's feature (H wide: no ``fc``). The layers are plain PyTorch, operation
for operation the anchors' (vLLM's ``llama_eagle.py``, ``llama_eagle3.py``), on the engine's
attention backend; the head runs whole on every rank (no collective inside a draft chain).
"""

from collections.abc import Iterable

import torch
import torch.nn as nn

from workers.attention.metadata import AttentionMetadata
from workers.layers.linear import QKVParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.parallel import TensorParallelGroup
from workers.layers.rotary import RotaryEmbedding
from workers.models.llama import (
    DecoderFlavor,
    LlamaAttention,
    LlamaMLP,
    default_weight_loader,
    fused_name,
    head_dim_of,
    required_shards,
)
from workers.speculative.eagle.head_config import EagleHeadConfig


class EagleLayer(nn.Module):
    def __init__(self, config: EagleHeadConfig, index: int, backend) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        hf, tp = config.hf_config(), TensorParallelGroup.single()
        size, eps = config.hidden_size, hf.rms_norm_eps
        self.eagle3_input = config.method == "eagle3" and index == 0
        self.norm_before_residual = config.norm_before_residual
        # EAGLE-1's first layer has no input norm (its input is fc's output)
        self.input_layernorm = None if config.method == "eagle" and index == 0 else \
            RMSNorm(size, eps)
        self.hidden_norm = RMSNorm(size, eps) if self.eagle3_input else None
        flavor = DecoderFlavor.of(hf)
        self.self_attn = LlamaAttention(hf, tp, backend, flavor, fused=False)
        if self.eagle3_input:  # attention over concat(embedding, feature)
            self.self_attn.qkv_proj = QKVParallelLinear(
                2 * size, head_dim_of(hf), hf.num_attention_heads, hf.num_key_value_heads, tp,
                bias=flavor.qkv_bias)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.mlp = LlamaMLP(hf, tp, flavor, fused=False)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                embeds: torch.Tensor, cos, sin, cache, meta: AttentionMetadata,  # type: ignore[no-untyped-def]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in, (the MLP's output, the residual before it) out, as vLLM's
        layers pass them: the stream is their sum."""
        if self.eagle3_input:
            assert self.input_layernorm is not None and self.hidden_norm is not None
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        elif residual is None:
            residual = hidden
            x = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        else:
            residual = hidden + residual
            assert self.input_layernorm is not None
            x = self.input_layernorm(residual)
        residual = self.self_attn(x, cos, sin, cache, meta) + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class EagleHead(nn.Module):
    def __init__(self, config: EagleHeadConfig, backend) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.config = config
        hf = config.hf_config()
        size = config.hidden_size
        self.is_eagle3 = config.method == "eagle3"
        # the target's embedding (and, EAGLE-1, its lm_head), whole: set by share_target
        self.embed_tokens = nn.Embedding(hf.vocab_size, size)
        self.embed_tokens.weight.requires_grad_(False)
        fc_in = config.feature_size if self.is_eagle3 else 2 * size
        self.fc = nn.Linear(fc_in, size, bias=config.fc_bias)
        self.layers = nn.ModuleList(EagleLayer(config, index, backend)
                                    for index in range(hf.num_hidden_layers))
        self.norm = RMSNorm(size, hf.rms_norm_eps) if self.is_eagle3 else None
        vocab = config.draft_vocab_size if self.is_eagle3 else hf.vocab_size
        self.lm_head = nn.Linear(size, vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.int64))
        # draft id i's target id, i + d2t[i], kept with d2t (load_weights): a chain step's
        # drafts are one gather, not a gather and an add (each a launch of the host's)
        self.register_buffer("target_ids", torch.arange(vocab), persistent=False)
        self.rotary_emb = RotaryEmbedding(hf, head_dim_of(hf))
        for param in self.parameters():
            param.requires_grad_(False)

    def share_target(self, embedding: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        """The target's whole embedding, and for EAGLE-1 its whole lm_head (an EAGLE-3 head
        has its own)."""
        self.embed_tokens.weight.data = embedding
        if not self.is_eagle3:
            if lm_head is None:
                raise ValueError("an EAGLE-1 head needs its target's lm_head")
            self.lm_head.weight.data = lm_head

    def build_rotary_table(self, num_positions: int) -> None:
        weight = self.fc.weight
        self.rotary_emb.build_table(num_positions, weight.dtype, weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                features: torch.Tensor, kv_caches, meta: AttentionMetadata,  # type: ignore[no-untyped-def]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) tokens at (T,) positions with (T, F) features: (the rows for the lm_head,
        the next step's features), each (T, H). F is the target's features' width, or H for
        features the head made itself."""
        embeds = self.embed_tokens(input_ids)
        if self.is_eagle3:
            hidden = self.fc(features) if features.shape[-1] != embeds.shape[-1] else features
        else:
            hidden = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rotary_emb(positions, embeds.dtype)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, embeds, cos, sin, cache, meta)
        assert residual is not None
        stream = hidden + residual
        if self.norm is None:
            return stream, stream
        return self.norm(stream), stream

    def draft_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """(T, H) rows → (T,) greedy drafts as target token ids."""
        best = self.lm_head(rows).argmax(dim=-1)
        return self.target_ids[best] if self.is_eagle3 else best

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """(T, H) → (T, target vocabulary) logits; tokens outside the draft's reduced
        vocabulary at -inf."""
        logits = self.lm_head(rows)
        if not self.is_eagle3:
            return logits
        full = logits.new_full((rows.shape[0], self.embed_tokens.num_embeddings), -torch.inf)
        return full.index_copy_(1, self.target_ids, logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads a head's tensors by canonical name (head_weights.canonical_name). A
        checkpoint's embedding, and t2d, are not needed (the target's embedding is shared;
        d2t says the same as t2d)."""
        params = dict(self.named_parameters())
        params["d2t"] = self.d2t  # type: ignore[assignment]
        skipped = {"embed_tokens.weight", "t2d"} | (set() if self.is_eagle3 else
                                                    {"lm_head.weight"})
        loaded: dict[str, set] = {}
        for name, tensor in weights:
            if name in skipped:
                continue
            name, shard_id = fused_name(name)
            if name not in params:
                raise ValueError(f"EAGLE head tensor {name!r} matches no parameter of the head")
            param = params[name]
            if name == "d2t":
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"d2t has shape {tuple(tensor.shape)}, the draft "
                                     f"vocabulary {tuple(param.shape)}")
                param.copy_(tensor.to(torch.int64))
                self.target_ids.copy_(torch.arange(len(param), device=param.device) + param)
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.setdefault(name, set()).add(shard_id)
        needed = [name for name in params if name not in skipped and name != "d2t"
                  and not name.startswith("embed_tokens.")]
        missing = [name for name in needed if loaded.get(name) != required_shards(name)]
        if missing:
            raise ValueError(f"EAGLE head checkpoint is missing: {', '.join(missing)}")
