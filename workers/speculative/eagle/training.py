"""Training an EAGLE-3 head from its target's own answers: the math (cluster/draft_head.py
runs it).

The head is trained as it drafts, by EAGLE-3's "training-time test" (TTT): at step 0 every
position i takes (token i + 1, the target's features at i); at step j the input token is the
true one at i + j + 1 and the hidden input the head's own output of step j - 1 at i, at rotary
position i + j. A query of step j attends to step 0's keys of positions up to i and to its own
chain's keys of steps 1..j at i (the K/V a draft chain anchored at i would have made), so each
step sees what drafting step j sees. Step j at i predicts token i + j + 2: the loss is the
cross-entropy against the target's own distribution there, restricted to the draft vocabulary
(soft labels), on answer tokens only, weighted 0.8^j.

The draft vocabulary is the most frequent target tokens of the answers, sorted by id; draft
id i is target id ``i + d2t[i]``. The head is saved in the yuhuili / SpecForge EAGLE-3 layout
(``midlayer.*``), which workers/speculative/eagle/ loads.
"""

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

STEP_WEIGHT = 0.8  # the loss of TTT step j weighs STEP_WEIGHT ** j (SafeAILab's)


@dataclass(frozen=True)
class HeadShape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    max_position_embeddings: int

    @classmethod
    def for_target(cls, target, draft_vocab_size: int,  # type: ignore[no-untyped-def]
                   aux_layer_ids: tuple[int, ...] | None = None) -> "HeadShape":
        """One decoder layer of the target's own shape (EAGLE-3's choice)."""
        from workers.speculative.eagle.head_config import default_aux_layers

        layers = target.num_hidden_layers
        return cls(
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=getattr(target, "head_dim", None)
            or target.hidden_size // target.num_attention_heads,
            rope_theta=rope_theta_of(target),
            rms_norm_eps=float(target.rms_norm_eps), vocab_size=target.vocab_size,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            aux_layer_ids=tuple(aux_layer_ids or default_aux_layers(layers)),
            max_position_embeddings=int(target.max_position_embeddings))


def rope_theta_of(target) -> float:  # type: ignore[no-untyped-def]
    """The target's rotary base (a plain one: the trainer's rotary has no scaling)."""
    parameters = getattr(target, "rope_parameters", None) or getattr(
        target, "rope_scaling", None) or {}
    if not isinstance(parameters, dict):
        parameters = {}
    if parameters.get("rope_type", parameters.get("type", "default")) != "default":
        raise ValueError("training a head for a target with scaled rotary embeddings is not "
                         "supported yet")
    theta = getattr(target, "rope_theta", None) or (
        parameters.get("rope_theta") if isinstance(parameters, dict) else None)
    return float(theta or 10000.0)


def draft_vocabulary(answers: Iterable[list[int]], size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of the answers (ties: the lower id), sorted by id."""
    counts = Counter(token for answer in answers for token in answer)
    best = sorted(counts, key=lambda token: (-counts[token], token))[:size]
    return torch.tensor(sorted(best), dtype=torch.int64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


class TrainableHead(nn.Module):
    """EAGLE-3's parameters under their checkpoint names (``midlayer.*`` flattened to
    ``midlayer_*`` as module names), with a dense TTT forward."""

    def __init__(self, shape: HeadShape, embedding: torch.Tensor, draft_ids: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        size, heads, kv_heads, dim = (shape.hidden_size, shape.num_attention_heads,
                                      shape.num_key_value_heads, shape.head_dim)
        self.register_buffer("embedding", embedding.detach().float().clone())  # frozen
        self.register_buffer("draft_ids", draft_ids)
        self.fc = nn.Linear(len(shape.aux_layer_ids) * size, size, bias=False)
        self.q_proj = nn.Linear(2 * size, heads * dim, bias=False)
        self.k_proj = nn.Linear(2 * size, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(2 * size, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, size, bias=False)
        self.gate_proj = nn.Linear(size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, size, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(size))
        self.hidden_norm = nn.Parameter(torch.ones(size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(size))
        self.norm = nn.Parameter(torch.ones(size))
        # the target's own lm_head rows of the draft vocabulary: a head that starts where the
        # target's logits are
        self.lm_head = nn.Linear(size, len(draft_ids), bias=False)
        self.lm_head.weight.data.copy_(lm_head.detach().float()[draft_ids])
        half = dim // 2
        self.register_buffer("inv_freq", 1.0 / (shape.rope_theta ** (
            torch.arange(0, half, dtype=torch.float32) * 2 / dim)))

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self.inv_freq
        cos, sin = (torch.cat([angles, angles], -1).cos()[:, None],
                    torch.cat([angles, angles], -1).sin()[:, None])
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, steps: int,
                segments: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``tokens`` (T,) of one sequence, ``features`` (T, 3H): each TTT step's draft
        logits (n, draft vocabulary) at indices i = 0..n-1 (n = T - 1), step j predicting
        token i + j + 2 (rows past the sequence's end are computed and must be masked).
        ``segments`` (T,), ascending, packs several sequences into one call: a token attends
        within its own segment, at rotary positions counted from the segment's start (rows
        predicting past their segment's end are computed and must be masked)."""
        shape, n = self.shape, tokens.shape[0] - 1
        heads, kv_heads, dim = shape.num_attention_heads, shape.num_key_value_heads, \
            shape.head_dim
        eps, index = shape.rms_norm_eps, torch.arange(n, device=tokens.device)
        hidden = self.fc(features[:n])
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: (K, V) (n, heads, dim)
        causal = index[None, :] <= index[:, None]  # step 0: key m <= query i
        offset = index
        if segments is not None:
            own = segments[:n]
            causal &= own[None, :] == own[:, None]
            offset = index - torch.searchsorted(own, own)  # from the segment's first token
        logits = []
        for step in range(steps):
            ids = tokens[(index + step + 1).clamp(max=n)]
            positions = offset + step
            normed = rms_norm(hidden, self.hidden_norm, eps)
            x = torch.cat([rms_norm(self.embedding[ids], self.input_layernorm, eps), normed], -1)
            q = self._rotary(self.q_proj(x).view(n, heads, dim), positions)
            k = self._rotary(self.k_proj(x).view(n, kv_heads, dim), positions)
            v = self.v_proj(x).view(n, kv_heads, dim)
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
            keys.append((k, v))
            k0, v0 = keys[0]
            scores = torch.einsum("qhd,khd->hqk", q, k0) * dim ** -0.5
            scores = scores.masked_fill(~causal, -torch.inf)
            own = torch.stack([(q * kj).sum(-1) for kj, _ in keys[1:]], -1) * dim ** -0.5 \
                if step else None  # (n, heads, step): the chain's own keys at i
            if own is not None:
                weights = torch.cat([scores, own.permute(1, 0, 2)], -1).softmax(-1)
                out = torch.einsum("hqk,khd->qhd", weights[..., :n], v0)
                for j, (_, vj) in enumerate(keys[1:]):
                    out = out + weights[..., n + j].permute(1, 0)[..., None] * vj
            else:
                out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v0)
            stream = hidden + self.o_proj(out.reshape(n, heads * dim))
            mlp_in = rms_norm(stream, self.post_attention_layernorm, eps)
            stream = stream + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))
            logits.append(self.lm_head(rms_norm(stream, self.norm, eps)))
            hidden = stream  # the next step's hidden input: this step's pre-norm output
        return logits


def ttt_loss(logits: list[torch.Tensor], target_probs: torch.Tensor,
             answer_mask: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Soft cross-entropy of each TTT step against the target's distribution (T, draft
    vocabulary) at the position before the predicted token, on answer tokens:
    ``answer_mask`` (T,) says which tokens are the answer's; with ``segments`` (packed
    sequences), only predictions within the anchor's own sequence count."""
    n = target_probs.shape[0] - 1
    total = torch.zeros((), device=target_probs.device)
    index = torch.arange(n, device=target_probs.device)
    for step, step_logits in enumerate(logits):
        predicted = index + step + 2  # the token's index
        valid = predicted <= n
        valid &= answer_mask[predicted.clamp(max=n)]
        if segments is not None:
            valid &= segments[predicted.clamp(max=n)] == segments[index]
        if not valid.any():
            continue
        probs = target_probs[(predicted - 1).clamp(max=n)]
        loss = -(probs * step_logits.log_softmax(-1)).sum(-1)
        total = total + STEP_WEIGHT ** step * loss[valid].mean()
    return total


def checkpoint_tensors(model: TrainableHead) -> dict[str, torch.Tensor]:
    """The head's trained tensors under their EAGLE-3 checkpoint names."""
    return {
        "fc.weight": model.fc.weight,
        "midlayer.self_attn.q_proj.weight": model.q_proj.weight,
        "midlayer.self_attn.k_proj.weight": model.k_proj.weight,
        "midlayer.self_attn.v_proj.weight": model.v_proj.weight,
        "midlayer.self_attn.o_proj.weight": model.o_proj.weight,
        "midlayer.mlp.gate_proj.weight": model.gate_proj.weight,
        "midlayer.mlp.up_proj.weight": model.up_proj.weight,
        "midlayer.mlp.down_proj.weight": model.down_proj.weight,
        "midlayer.input_layernorm.weight": model.input_layernorm,
        "midlayer.hidden_norm.weight": model.hidden_norm,
        "midlayer.post_attention_layernorm.weight": model.post_attention_layernorm,
        "norm.weight": model.norm,
        "lm_head.weight": model.lm_head.weight,
    }


def save_head(model: TrainableHead, folder: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The head in the yuhuili / SpecForge EAGLE-3 layout (tensors in ``dtype``)."""
    from safetensors.torch import save_file

    shape = model.shape
    folder.mkdir(parents=True, exist_ok=True)
    draft_ids = model.draft_ids.cpu()
    out = {name: t.detach().to("cpu", dtype).contiguous()
           for name, t in checkpoint_tensors(model).items()}
    out["d2t"] = draft_ids - torch.arange(len(draft_ids))
    out["t2d"] = torch.zeros(shape.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
    save_file(out, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta, "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "draft_vocab_size": len(draft_ids), "target_hidden_size": shape.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(shape.aux_layer_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_trainable_head(folder: Path, target, embedding: torch.Tensor,  # type: ignore[no-untyped-def]
                        lm_head: torch.Tensor) -> TrainableHead:
    """A head ``save_head`` wrote, to train on (more epochs, more answers, another call of a
    device with a time limit): its draft vocabulary and streams kept, refused when its shape
    is not the one ``target`` gives."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / "model.safetensors"))
    config = json.loads((Path(folder) / "config.json").read_text())
    draft_ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    shape = HeadShape.for_target(target, len(draft_ids),
                                 tuple(config["eagle_aux_hidden_state_layer_ids"]))
    head = TrainableHead(shape, embedding, draft_ids, lm_head)
    for name, parameter in checkpoint_tensors(head).items():
        if tensors[name].shape != parameter.shape:
            raise ValueError(f"{folder}: {name} is {tuple(tensors[name].shape)}, the target "
                             f"gives {tuple(parameter.shape)}")
        parameter.data.copy_(tensors[name].float())
    return head
