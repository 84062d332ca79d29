"""Llama-family decoders: Llama, Mistral, Qwen2 and Qwen3 in one implementation.

The families differ only in small switches (DecoderFlavor): Qwen2 adds q/k/v biases, Qwen3
normalizes each query and key head before rotary and may set a head_dim other than
hidden / heads. Module and parameter names follow the HF checkpoints, except that q/k/v_proj
are fused into qkv_proj and gate/up_proj into gate_up_proj.

With ``fused=True`` (CUDA with Triton) the small elementwise steps run as Triton kernels
(workers/layers/fused_kernels.py, attention_input.py, gemv.py), and each decoder norm's weight
is folded into the projection after it once the weights are loaded (fold_norm_weights): a
layer of several rows then runs no norm kernel at all — qkv and gate_up read the residual
stream itself, the kernels after them scale each row by its 1 / RMS, and o and down add into
the stream inside their GEMM. A row of one token (a batch-1 decode step) takes the fused
matrix-vector kernels, which keep the norm (of weight 1) and the residual add inside.
With ``fused=False`` the layers are plain PyTorch, operation for operation HF's, so float32
outputs match HF on the CPU.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.attention.key_rotation import rotate, stored_keys
from workers.attention.layer_cache import LayerKVCache
from workers.attention.metadata import AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardedLinear,
    copy_shard,
)
from workers.layers.norm import FusedRMSNorm, RMSNorm
from workers.layers.parallel import TensorParallelGroup
from workers.layers.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:  # transformers is imported where a config is read, not to run a shard
    from transformers import PretrainedConfig

    from workers.layer_gate import LayerGate

# (fused parameter, checkpoint name, shard id): checkpoint tensors that load into a slice
STACKED_PARAMS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


@dataclass(frozen=True)
class DecoderFlavor:
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, config: PretrainedConfig) -> DecoderFlavor:
        attention_bias = getattr(config, "attention_bias", False)
        return cls(
            qkv_bias=attention_bias or config.model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=getattr(config, "mlp_bias", False),
            qk_norm=config.model_type == "qwen3",
        )


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_cache_shape_per_layer(config: PretrainedConfig, tp_size: int) -> tuple[int, int]:
    """(num_local_kv_heads, head_dim) of one layer's cache on one rank; see QKVParallelLinear."""
    return max(1, config.num_key_value_heads // tp_size), head_dim_of(config)


def tensor_parallel_sizes(config: PretrainedConfig, limit: int = 8) -> list[int]:
    """The shard counts up to ``limit`` this decoder splits into (see QKVParallelLinear and
    MergedColumnParallelLinear): every count dividing the query heads and the MLP's width,
    with the KV heads split evenly or each replicated on a whole number of ranks."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return [tp for tp in range(1, limit + 1)
            if heads % tp == 0 and config.intermediate_size % tp == 0
            and (kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0)]


def check_tensor_parallel(config: PretrainedConfig, tp_size: int) -> None:
    """A clear error, before any shard starts, where tp_size does not split this model."""
    if tp_size not in tensor_parallel_sizes(config, max(tp_size, 8)):
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not split this model: "
            f"{config.num_attention_heads} attention heads over "
            f"{config.num_key_value_heads} kv heads, intermediate size "
            f"{config.intermediate_size} (sizes that do: "
            f"{', '.join(map(str, tensor_parallel_sizes(config)))})")


def num_layers(config: PretrainedConfig) -> int:
    return config.num_hidden_layers


def check_supported(config: PretrainedConfig) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise NotImplementedError(
            f"sliding-window attention is not supported (sliding_window={window} < "
            f"max_position_embeddings={config.max_position_embeddings})"
        )


def make_norm(size: int, eps: float, fused: bool) -> RMSNorm:
    return FusedRMSNorm(size, eps) if fused else RMSNorm(size, eps)


class LlamaAttention(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup, backend, flavor: DecoderFlavor, fused):
        super().__init__()
        self.backend = backend
        self.fused = fused
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            config.num_key_value_heads, tp, bias=flavor.qkv_bias,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, tp, bias=flavor.o_bias
        )
        eps = config.rms_norm_eps
        # per-head norms: plain modules; fused, the attention-input kernel reads their weights
        self.q_norm = RMSNorm(self.head_dim, eps) if flavor.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if flavor.qk_norm else None

    def forward(self, hidden, cos, sin, cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(self.qkv_proj(hidden), cos, sin, cache, meta)

    def forward_one_token(
        self, hidden, residual, norm, cos, sin, cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For one row, fused: (o_proj's output, the new residual). In models without per-head
        q/k norms (all but Qwen3) the input norm, qkv, rotary and the K/V store are one kernel;
        not into a quantized cache, whose scale needs a whole head in one program (that
        kernel splits heads across programs): there the attention-input kernel stores."""
        if self.q_norm is not None or cache.quantized:
            qkv, residual = norm.project(hidden, residual, self.qkv_proj)
            return self.attend(qkv, cos, sin, cache, meta), residual
        # imported here: models built without the fused kernels must not need Triton
        from workers.layers.gemv import qkv_rotary_store

        q, residual = qkv_rotary_store(
            hidden, self.qkv_proj.weight, self.qkv_proj.bias, residual, norm.weight, norm.eps,
            cos, sin, cache.k, cache.v, meta.slot_mapping, self.qkv_proj.num_local_heads,
        )  # fmt: skip
        out = self.backend.attend(q, cache, meta, scale=self.scale)
        return self.o_proj(out.flatten(1)), residual

    def attend(self, qkv, cos, sin, cache, meta: AttentionMetadata) -> torch.Tensor:
        """qkv: (T, (local_heads + 2 * local_kv_heads) * head_dim) → o_proj's output."""
        if self.fused:
            return self.o_proj(self.attention_output(qkv, cos, sin, cache, meta))
        sizes = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        q, k, v = qkv.split(sizes, dim=-1)
        q = q.view(-1, self.qkv_proj.num_local_heads, self.head_dim)  # (T, heads, head_dim)
        k = k.view(-1, self.qkv_proj.num_local_kv_heads, self.head_dim)  # (T, kv_heads, head_dim)
        v = v.view(-1, self.qkv_proj.num_local_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # a cache of rotated keys (workers/attention/key_rotation.py): q turns with k
        q, k = rotate(q, cache.key_rotation), stored_keys(k, cache)
        out = self.backend.forward(q, k, v, cache, meta, scale=self.scale)
        return self.o_proj(out.flatten(1))  # (T, heads, head_dim) → (T, hidden)

    def attention_output(
        self, qkv, cos, sin, cache, meta: AttentionMetadata, row_scale=None
    ) -> torch.Tensor:
        """Fused: qkv → the attention's output (T, local_heads * head_dim), before o_proj.
        row_scale (rows, eps): qkv came from unnormalized rows (see attention_input)."""
        # imported here: models built without the fused kernels must not need Triton
        from workers.layers.attention_input import attention_input

        norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm else (None, None)
        eps = self.q_norm.eps if self.q_norm else 0.0
        # a cache of rotated keys: q turns with k, in the kernel (key_rotation holds H)
        q = attention_input(qkv, self.qkv_proj.num_local_heads, cos, sin, cache.k, cache.v,
                            meta.slot_mapping, *norms, eps=eps, row_scale=row_scale,
                            k_scale=cache.k_scale, v_scale=cache.v_scale,
                            key_center=cache.key_center, rotate=cache.key_rotation is not None)
        return self.backend.attend(q, cache, meta, scale=self.scale).flatten(1)


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup, flavor: DecoderFlavor, fused: bool):
        super().__init__()
        self.fused = fused
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], tp, flavor.mlp_bias
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, tp, flavor.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            # imported here: models built without the fused kernels must not need Triton
            from workers.layers.fused_kernels import silu_and_mul

            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each (T, local_intermediate)
        return self.down_proj(F.silu(gate) * up)


def project_stream(norm: RMSNorm, proj: ShardedLinear, stream: torch.Tensor):
    """(proj's output, row_scale for the kernel after it) for a projection whose norm's weight
    is folded into it: the stream itself projected, each row to be scaled by its 1 / RMS
    after; with a bias (added after the norm's scale, not scaled by it) the norm, of weight 1,
    runs first instead."""
    if proj.bias is None:
        return proj(stream), (stream, norm.eps)
    return proj(norm(stream)), None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup, backend, flavor: DecoderFlavor, fused):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = make_norm(size, eps, fused)
        self.self_attn = LlamaAttention(config, tp, backend, flavor, fused)
        self.post_attention_layernorm = make_norm(size, eps, fused)
        self.mlp = LlamaMLP(config, tp, flavor, fused)

    def forward(self, hidden, cos, sin, cache, meta: AttentionMetadata) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, cache, meta)
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(self, hidden, cos, sin, cache, meta: AttentionMetadata):
        """Fused, norm weights folded, several rows: the residual stream hidden (T, hidden)
        through the layer, updated in place and returned. No norm kernel runs: qkv and gate_up
        project the stream itself (their weights hold the norms'), the attention input and
        SiLU * up scale each row by its 1 / RMS, and o and down add into the stream inside
        their GEMM — two launches fewer a layer than an add + RMSNorm kernel before each."""
        # imported here: models built without the fused kernels must not need Triton
        from workers.layers.fused_kernels import silu_and_mul

        attn, mlp = self.self_attn, self.mlp
        qkv, row_scale = project_stream(self.input_layernorm, attn.qkv_proj, hidden)
        out = attn.attention_output(qkv, cos, sin, cache, meta, row_scale=row_scale)
        hidden = attn.o_proj.add_into(hidden, out)
        gate_up, row_scale = project_stream(self.post_attention_layernorm, mlp.gate_up_proj, hidden)
        return mlp.down_proj.add_into(hidden, silu_and_mul(gate_up, row_scale=row_scale))

    def forward_one_token(self, hidden, residual, cos, sin, cache, meta):
        """Fused, for a decode step of one sequence: (hidden, residual) → (mlp output, residual
        before it), residual None at the first layer. Each norm runs inside the projection
        after it, SiLU * up inside gate_up, rotary and the K/V store inside qkv
        (workers/layers/gemv.py): 6 fewer launches, 4 with per-head q/k norms."""
        hidden, residual = self.self_attn.forward_one_token(
            hidden, residual, self.input_layernorm, cos, sin, cache, meta
        )
        mlp = self.mlp
        act, residual = self.post_attention_layernorm.project(
            hidden, residual, mlp.gate_up_proj, silu_mul=True
        )
        return mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup, backend, flavor: DecoderFlavor, fused):
        super().__init__()
        self.fused = fused
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp, backend, flavor, fused)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = make_norm(config.hidden_size, config.rms_norm_eps, fused)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))
        self.norms_folded = False
        # EAGLE-3's features (workers/speculative/eagle/): the residual stream entering these
        # layers, concatenated in their order, kept in aux_features after each forward
        self.aux_layers: tuple[int, ...] = ()
        self.aux_features: torch.Tensor | None = None
        # a step that loads KV blocks from the host tier layer by layer: each layer waits for
        # its own (workers/layer_gate.py); None: nothing to wait for
        self.layer_gate: LayerGate | None = None
        # a state dict holds the checkpoint's weights: loading one unfolds them
        self.register_load_state_dict_pre_hook(lambda *_: setattr(self, "norms_folded", False))
        if fused:  # rows of one token take the fused matrix-vector kernels
            for module in self.modules():
                if isinstance(module, ShardedLinear):
                    module.gemv_for_one_row = True

    @torch.no_grad()
    def fold_norm_weights(self) -> None:
        """Moves each decoder norm's weight into the projection after it: qkv_proj's and
        gate_up_proj's input columns are multiplied by it (in float32, rounded once) and the
        norm's weight becomes 1. The model computes the same function; fused layers of several
        rows rely on it (forward_fused). Idempotent; the final norm (before the LM head) keeps
        its weight."""
        for layer in self.layers:
            pairs = ((layer.input_layernorm, layer.self_attn.qkv_proj),
                     (layer.post_attention_layernorm, layer.mlp.gate_up_proj))  # fmt: skip
            for norm, proj in pairs:
                weight = proj.weight.data
                weight.copy_((weight.float() * norm.weight.data.float()).to(weight.dtype))
                norm.weight.data.fill_(1.0)
        self.norms_folded = True

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # (T, head_dim) each
        streams: dict[int, torch.Tensor] = {}  # the residual stream entering aux_layers
        aux = self.aux_layers
        if self.fused:
            if not self.norms_folded:
                raise RuntimeError("a fused model runs with its norm weights folded into its "
                                   "projections: call fold_norm_weights() after loading weights")
            layers = enumerate(zip(self.layers, kv_caches, strict=True))
            if hidden.shape[0] == 1:
                residual = None
                for index, (layer, cache) in layers:
                    self._before_layer(index)
                    if index in aux:
                        streams[index] = hidden if residual is None else hidden + residual
                    hidden, residual = layer.forward_one_token(
                        hidden, residual, cos, sin, cache, meta
                    )
                self._keep_aux(streams)
                return self.norm(hidden, residual)[0]
            for index, (layer, cache) in layers:
                self._before_layer(index)
                if index in aux:
                    streams[index] = hidden.clone()  # the layer adds into it in place
                hidden = layer.forward_fused(hidden, cos, sin, cache, meta)
            self._keep_aux(streams)
            return self.norm(hidden)
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            self._before_layer(index)
            if index in aux:
                streams[index] = hidden
            hidden = layer(hidden, cos, sin, cache, meta)
        self._keep_aux(streams)
        return self.norm(hidden)

    def _before_layer(self, index: int) -> None:
        if self.layer_gate is not None:
            self.layer_gate.before_layer(index)

    def _keep_aux(self, streams: dict[int, torch.Tensor]) -> None:
        if self.aux_layers:
            self.aux_features = torch.cat([streams[i] for i in self.aux_layers], dim=-1)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    copy_shard(param.data, loaded)


def fused_name(name: str) -> tuple[str, object]:
    """A checkpoint tensor's parameter name and its shard id in it (q/k/v into qkv_proj,
    gate/up into gate_up_proj; None for a tensor that is a parameter of its own)."""
    for fused, original, shard_id in STACKED_PARAMS:
        if original in name:
            return name.replace(original, fused), shard_id
    return name, None


def required_shards(name: str) -> set:
    shards = {shard_id for fused, _, shard_id in STACKED_PARAMS if fused in name}
    return shards or {None}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: PretrainedConfig, tp: TensorParallelGroup, backend, fused: bool = False
    ):
        """fused: Triton kernels for norms, rotary and SiLU (see the module docstring)."""
        super().__init__()
        check_supported(config)
        self.config = config
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.model = LlamaModel(config, tp, backend, DecoderFlavor.of(config), fused)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[LayerKVCache],  # per layer: K, V and a quantized cache's scales
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final normed hidden states, (T, hidden); pick the rows to sample, then compute_logits."""
        return self.model(input_ids, positions, kv_caches, meta)

    def build_rotary_table(self, num_positions: int) -> None:
        """Precomputes rotary cos/sin for positions below num_positions (every position a
        step may then take): a step gathers its rows instead of computing them."""
        embedding = self.model.embed_tokens.weight
        self.model.rotary_emb.build_table(num_positions, embedding.dtype, embedding.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) → (N, vocab_size) over the full vocabulary, on every rank."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named checkpoint tensors, each parameter slicing out its own shard."""
        # a tied lm_head.weight is listed once, under the embedding's name
        params = dict(self.named_parameters())
        self.model.norms_folded = False  # the checkpoint's norm weights are about to come in
        loaded: dict[str, set] = defaultdict(set)
        for name, tensor in weights:
            if "rotary_emb." in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue  # recomputed from the config / the same tensor as the embedding
            name, shard_id = fused_name(name)
            if name not in params:
                model_name = type(self).__name__
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {model_name}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded[name].add(shard_id)
        missing = [name for name in params if loaded[name] != required_shards(name)]
        if missing:
            raise ValueError(f"checkpoint is missing parameters: {', '.join(missing)}")
        if self.model.fused:
            self.model.fold_norm_weights()
