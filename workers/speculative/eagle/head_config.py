"""What an EAGLE head is, read from its folder: which method (EAGLE-1 or EAGLE-3), which
checkpoint layout, its decoder layer's shape, and how it plugs into its target.

Three layouts are published (../shared/anchors/eagle.md §1):

- ``eagle1``: yuhuili EAGLE-1/2 heads: a one-layer Llama config; ``fc`` over
  concat(embedding, the target's final hidden state), ``layers.0.*`` without an input norm,
  ``embed_tokens``; no norm, no lm_head (the target's).
- ``eagle3``: yuhuili / SpecForge EAGLE-3 heads: ``midlayer.*`` whose attention reads 2H
  (concat(norm(embedding), norm(hidden))), ``fc`` over three target features, its own ``norm``
  and ``lm_head`` over a reduced vocabulary mapped by ``d2t``.
- ``speculators``: vllm-project/speculators' EAGLE-3: ``layers.0.*`` for ``midlayer.*``, the
  layer's config nested in ``transformer_layer_config``.

The method is read from the checkpoint, never from an architecture string (hub configs say
``LlamaForCausalLM``, ``LlamaForCausalLMEagle3`` or ``Eagle3Speculator`` for the same thing).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.speculative.eagle.head_weights import canonical_name, checkpoint_names

if TYPE_CHECKING:
    from transformers import PretrainedConfig

METHODS = ("eagle", "eagle3")
# newer speculators flags whose forward this head does not implement: refused, not ignored
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class EagleHeadConfig:
    method: str  # "eagle" (EAGLE-1) or "eagle3"
    layout: str  # "eagle1", "eagle3" or "speculators"
    layer: dict[str, Any]  # a Llama config of the head's decoder layer(s)
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: the target layers whose input stream it reads
    draft_vocab_size: int  # EAGLE-3's reduced vocabulary; EAGLE-1: the target's
    norm_before_residual: bool
    fc_bias: bool

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    @property
    def num_features(self) -> int:
        """Target features a position feeds the head: 3 for EAGLE-3, 1 for EAGLE-1."""
        return len(self.aux_layer_ids) if self.method == "eagle3" else 1

    @property
    def feature_size(self) -> int:
        return self.num_features * self.target_hidden_size

    def hf_config(self) -> "PretrainedConfig":
        """The head's layer as a transformers Llama config (rotary, KV cache shapes)."""
        from transformers import LlamaConfig

        return LlamaConfig(**self.layer)


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's features: the residual stream entering layers 2, L // 2 and L - 3 (the
    reference's, vLLM's and llama.cpp's choice; checkpoints that name others by ±1 exist),
    kept inside a target of fewer than 5 layers."""
    last = num_target_layers - 1
    return (min(2, last), num_target_layers // 2, max(num_target_layers - 3, 0))


def read_head_config(folder: Path, target: "PretrainedConfig",
                     method: str | None = None, max_model_len: int | None = None,
                     tensor_names: set[str] | None = None) -> EagleHeadConfig:
    """The head in ``folder`` for ``target``, checked against it: a clear ValueError naming
    what differs. ``method``: the one asked for ("eagle" or "eagle3"; None: the checkpoint's).
    ``tensor_names``: the checkpoint's (read from the folder when None)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"an EAGLE head folder needs a config.json: none in {folder}")
    raw = json.loads(path.read_text())
    if tensor_names is None:
        tensor_names = checkpoint_names(Path(folder))
    layout = layout_of(raw, tensor_names)
    found = "eagle3" if layout != "eagle1" else "eagle"
    if method is not None and method not in METHODS:
        raise ValueError(f"an EAGLE method is one of {', '.join(METHODS)}, got {method!r}")
    if method is not None and method != found:
        raise ValueError(f"speculative method {method!r} asked for, but {folder} holds an "
                         f"{'EAGLE-3' if found == 'eagle3' else 'EAGLE-1'} head "
                         f"(method {found!r})")
    layer = dict(raw.get("transformer_layer_config", raw)) if layout == "speculators" else \
        dict(raw)
    for flag in UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise ValueError(f"EAGLE head {folder}: {flag}=true is not supported")
    eagle_config = raw.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError(f"EAGLE head {folder}: use_aux_hidden_state=false (a head over the "
                         "last layer alone) is not supported")
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids")
    # the head's RoPE must reach every position the target serves (yuhuili configs say 2048)
    target_len = max_model_len or target.max_position_embeddings
    layer["max_position_embeddings"] = max(int(layer.get("max_position_embeddings", 0)),
                                           int(target_len))
    layer.setdefault("rms_norm_eps", getattr(target, "rms_norm_eps", 1e-6))
    layer["vocab_size"] = int(layer.get("vocab_size", target.vocab_size))
    for key in ("architectures", "torch_dtype", "dtype", "draft_vocab_size",
                "transformers_version", "auto_map"):
        layer.pop(key, None)
    config = EagleHeadConfig(
        method=found, layout=layout, layer=layer,
        target_hidden_size=int(raw.get("target_hidden_size") or target.hidden_size),
        aux_layer_ids=tuple(aux) if aux else default_aux_layers(target.num_hidden_layers),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        fc_bias=any(canonical_name(name) == "fc.bias" for name in tensor_names),
    )
    check_fits(config, target, folder)
    return config


def head_method_in(folder: Path) -> str | None:
    """"eagle3" or "eagle" when ``folder`` holds an EAGLE head, else None (a model): an
    EAGLE-3 layout, or EAGLE-1's fc without an lm_head."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
        names = checkpoint_names(folder)
    except (OSError, ValueError):
        return None
    if layout_of(raw, names) != "eagle1":
        return "eagle3"
    canonical = {canonical_name(name) for name in names}
    return "eagle" if "fc.weight" in canonical and "lm_head.weight" not in canonical else None


def layout_of(raw: dict, tensor_names: set[str]) -> str:
    if raw.get("speculators_model_type") or "transformer_layer_config" in raw:
        return "speculators"
    if any(name.startswith("midlayer.") for name in tensor_names):
        return "eagle3"
    if "d2t" in tensor_names or raw.get("draft_vocab_size"):
        return "speculators"  # layers.0.* with a reduced vocabulary: EAGLE-3 renamed
    return "eagle1"


def check_fits(config: EagleHeadConfig, target: "PretrainedConfig", folder: Path) -> None:
    """Refuses a head whose shapes don't fit the target, saying what differs."""
    problems = []
    if config.target_hidden_size != target.hidden_size:
        problems.append(f"it reads features of width {config.target_hidden_size}, the target's "
                        f"hidden size is {target.hidden_size}")
    if config.hidden_size != target.hidden_size:
        problems.append(f"its hidden size is {config.hidden_size}, the target's "
                        f"{target.hidden_size} (it shares the target's embedding)")
    if config.layer["vocab_size"] != target.vocab_size:
        problems.append(f"its vocabulary is {config.layer['vocab_size']} tokens, the target's "
                        f"{target.vocab_size}")
    if config.draft_vocab_size > target.vocab_size:
        problems.append(f"its draft vocabulary ({config.draft_vocab_size}) is larger than the "
                        f"target's ({target.vocab_size})")
    bad_layers = [i for i in config.aux_layer_ids if not 0 <= i < target.num_hidden_layers]
    if config.method == "eagle3" and bad_layers:
        problems.append(f"it reads target layers {list(config.aux_layer_ids)}, the target has "
                        f"{target.num_hidden_layers}")
    if problems:
        raise ValueError(f"EAGLE head {folder} does not fit its target: " + "; ".join(problems))
