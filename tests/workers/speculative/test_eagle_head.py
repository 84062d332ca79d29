"""EAGLE heads in their three published layouts: read, checked against the target, loaded,
and run over the paged KV cache, against a reference forward of each written here (plain
PyTorch, whole-sequence causal attention, no engine code)."""

from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from tests.eagle_heads import DRAFT_VOCAB, HEADS, KV_HEADS, VOCAB, H, write_head
from workers.attention.reference import ReferenceAttentionBackend
from workers.input_batch import build_input_batch
from workers.kv_cache import allocate_kv_caches
from workers.speculative.eagle.head import EagleHead
from workers.speculative.eagle.head_config import default_aux_layers, read_head_config
from workers.speculative.eagle.head_weights import head_tensors
from workers.step_input import ScheduledRequest

TARGET = LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=8,
                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                     max_position_embeddings=512, rope_theta=10000.0)


# -- the reference: the anchors' forward, whole sequence, written from their description --

def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    dim = x.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[:, None].float() * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    return x * cos[:, None] + half * sin[:, None]


def attention(x: torch.Tensor, w: dict, prefix: str, positions: torch.Tensor) -> torch.Tensor:
    head_dim = H // HEADS
    q = (x @ w[f"{prefix}self_attn.q_proj.weight"].T).view(-1, HEADS, head_dim)
    k = (x @ w[f"{prefix}self_attn.k_proj.weight"].T).view(-1, KV_HEADS, head_dim)
    v = (x @ w[f"{prefix}self_attn.v_proj.weight"].T).view(-1, KV_HEADS, head_dim)
    q, k = rotary(q, positions), rotary(k, positions)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim ** 0.5
    causal = torch.ones(len(x), len(x), dtype=torch.bool).tril()
    out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, -torch.inf).softmax(-1), v)
    return out.flatten(1) @ w[f"{prefix}self_attn.o_proj.weight"].T


def mlp(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate = x @ w[f"{prefix}mlp.gate_proj.weight"].T
    up = x @ w[f"{prefix}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}mlp.down_proj.weight"].T


def reference_eagle1(w: dict, embedding: torch.Tensor, lm_head: torch.Tensor,
                     tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Logits: fc over concat(embedding, feature), the layer with no input norm, the output
    hidden + residual straight into the target's lm_head."""
    positions = torch.arange(len(tokens))
    x = torch.cat([embedding[tokens], features], -1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    stream = x + attention(x, w, "layers.0.", positions)
    stream = stream + mlp(rms(stream, w["layers.0.post_attention_layernorm.weight"]), w,
                          "layers.0.")
    return stream @ lm_head.T


def reference_eagle3(w: dict, prefix: str, embedding: torch.Tensor, tokens: torch.Tensor,
                     features: torch.Tensor, norm_before_residual: bool) -> torch.Tensor:
    """Logits over the target's vocabulary (-inf outside the draft's): fc over the three
    features, attention over concat(norm(embedding), norm(hidden)), the final norm, the
    head's own lm_head through d2t."""
    stream = eagle3_stream(w, prefix, embedding, tokens, features @ w["fc.weight"].T,
                           norm_before_residual)
    return eagle3_logits(w, stream, len(embedding))


def eagle3_stream(w: dict, prefix: str, embedding: torch.Tensor, tokens: torch.Tensor,
                  hidden: torch.Tensor, norm_before_residual: bool) -> torch.Tensor:
    """The pre-norm output stream, from each position's hidden input (fc of the target's
    features, or the head's own stream from the position before)."""
    positions = torch.arange(len(tokens))
    normed = rms(hidden, w[f"{prefix}hidden_norm.weight"])
    x = torch.cat([rms(embedding[tokens], w[f"{prefix}input_layernorm.weight"]), normed], -1)
    stream = (normed if norm_before_residual else hidden) + attention(x, w, prefix, positions)
    return stream + mlp(rms(stream, w[f"{prefix}post_attention_layernorm.weight"]), w, prefix)


def eagle3_logits(w: dict, stream: torch.Tensor, vocab: int) -> torch.Tensor:
    draft = rms(stream, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((len(stream), vocab), -torch.inf)
    full[:, torch.arange(DRAFT_VOCAB) + w["d2t"]] = draft
    return full


@dataclass
class Row:
    token_ids: list[int]
    block_ids: list[int]


def run_head(folder, tokens: torch.Tensor, features: torch.Tensor, embedding: torch.Tensor,
             lm_head: torch.Tensor, method: str | None = None) -> tuple[EagleHead, torch.Tensor]:
    """The head's logits at every position of one sequence, run as a prefill over the paged
    cache in blocks of 4 (so it spans several, in an order of its own)."""
    config = read_head_config(folder, TARGET, method)
    head = EagleHead(config, ReferenceAttentionBackend())
    head.load_weights(head_tensors(folder))
    head.share_target(embedding, lm_head)
    head.build_rotary_table(TARGET.max_position_embeddings)
    caches = allocate_kv_caches(config.hf_config(), 1, 8, 4, torch.float32, torch.device("cpu"))
    row = Row(tokens.tolist(), [5, 2, 7])
    batch = build_input_batch([ScheduledRequest("a", 0, len(tokens))], {"a": row}, 4,
                              torch.device("cpu"))
    rows, _ = head(batch.input_ids, batch.positions, features, caches, batch.meta)
    return head, head.compute_logits(rows)


@pytest.fixture
def target_weights():
    generator = torch.Generator().manual_seed(7)
    return torch.randn(VOCAB, H, generator=generator), torch.randn(VOCAB, H, generator=generator)


@pytest.mark.parametrize("fc_bias,bin_file", [(False, False), (True, True)])
def test_eagle1_head_matches_the_reference(tmp_path, target_weights, fc_bias, bin_file):
    embedding, lm_head = target_weights
    weights = write_head(tmp_path / "head", "eagle1", fc_bias=fc_bias, bin_file=bin_file)
    tokens = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(1))
    features = torch.randn(10, H, generator=torch.Generator().manual_seed(2))
    head, logits = run_head(tmp_path / "head", tokens, features, embedding, lm_head, "eagle")
    assert head.config.method == "eagle" and head.config.layout == "eagle1"
    # the head's own embed_tokens copy is not used: the target's is shared
    expected = reference_eagle1(weights, embedding, lm_head, tokens, features)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout,norm_before_residual",
                         [("eagle3", False), ("speculators", False), ("speculators", True)])
def test_eagle3_heads_match_the_reference(tmp_path, target_weights, layout,
                                          norm_before_residual):
    embedding, lm_head = target_weights
    weights = write_head(tmp_path / "head", layout, norm_before_residual=norm_before_residual)
    prefix = "midlayer." if layout == "eagle3" else "layers.0."
    tokens = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(1))
    features = torch.randn(10, 3 * H, generator=torch.Generator().manual_seed(2))
    head, logits = run_head(tmp_path / "head", tokens, features, embedding, lm_head)
    assert (head.config.method, head.config.layout) == ("eagle3", layout)
    expected = reference_eagle3(weights, prefix, embedding, tokens, features,
                                norm_before_residual)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # greedy drafts are target ids, each the best of the draft vocabulary
    rows, _ = head(tokens, torch.arange(10), features,
                   allocate_kv_caches(head.config.hf_config(), 1, 8, 4, torch.float32,
                                      torch.device("cpu")),
                   build_input_batch([ScheduledRequest("a", 0, 10)],
                                     {"a": Row(tokens.tolist(), [5, 2, 7])}, 4,
                                     torch.device("cpu")).meta)
    assert head.draft_tokens(rows).tolist() == expected.argmax(-1).tolist()


def test_d2t_maps_draft_ids_to_target_ids(tmp_path, target_weights):
    weights = write_head(tmp_path / "head", "eagle3")
    head, _ = run_head(tmp_path / "head", torch.tensor([1, 2]), torch.randn(2, 3 * H),
                       *target_weights)
    in_draft = torch.nonzero(weights["t2d"]).flatten()
    # draft id i is target id i + d2t[i]: the target ids t2d marks, in order
    assert (torch.arange(DRAFT_VOCAB) + head.d2t).tolist() == in_draft.tolist()
    one_hot = torch.zeros(1, H)
    head.lm_head.weight.data.zero_()
    head.lm_head.weight.data[3, 0] = 1.0  # draft id 3 wins
    assert head.draft_tokens(one_hot + torch.eye(1, H)).tolist() == [int(in_draft[3])]


def test_the_config_is_read_with_the_known_traps(tmp_path):
    write_head(tmp_path / "head", "eagle3")
    config = read_head_config(tmp_path / "head", TARGET, max_model_len=300)
    # the head's RoPE reaches every position the target serves (its config said 64)
    assert config.layer["max_position_embeddings"] == 300
    assert config.aux_layer_ids == default_aux_layers(8) == (2, 4, 5)
    assert config.feature_size == 3 * H and config.draft_vocab_size == DRAFT_VOCAB
    write_head(tmp_path / "named", "speculators",
               config_extra={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    assert read_head_config(tmp_path / "named", TARGET).aux_layer_ids == (1, 3, 6)


def test_a_head_that_does_not_fit_its_target_is_refused_with_what_differs(tmp_path):
    write_head(tmp_path / "head", "eagle3")
    wider = LlamaConfig(**{**TARGET.to_dict(), "hidden_size": 128, "vocab_size": 500})
    with pytest.raises(ValueError) as refused:
        read_head_config(tmp_path / "head", wider)
    assert str(refused.value) == (
        f"EAGLE head {tmp_path / 'head'} does not fit its target: its hidden size is 64, the "
        "target's 128 (it shares the target's embedding); its vocabulary is 101 tokens, the "
        "target's 500")
    write_head(tmp_path / "narrow", "speculators")  # names the features' width: 64
    with pytest.raises(ValueError, match="it reads features of width 64, the target's hidden "
                                         "size is 128"):
        read_head_config(tmp_path / "narrow", wider)
    shallow = LlamaConfig(**{**TARGET.to_dict(), "num_hidden_layers": 4})
    write_head(tmp_path / "deep", "speculators",
               config_extra={"eagle_aux_hidden_state_layer_ids": [1, 2, 5]})
    with pytest.raises(ValueError, match=r"it reads target layers \[1, 2, 5\], the target "
                                         r"has 4"):
        read_head_config(tmp_path / "deep", shallow)
    with pytest.raises(ValueError, match="speculative method 'eagle' asked for, but .* holds "
                                         "an EAGLE-3 head"):
        read_head_config(tmp_path / "head", TARGET, "eagle")
    write_head(tmp_path / "new", "speculators", config_extra={"norm_before_fc": True})
    with pytest.raises(ValueError, match="norm_before_fc=true is not supported"):
        read_head_config(tmp_path / "new", TARGET)


def test_a_checkpoint_missing_a_tensor_is_refused(tmp_path, target_weights):
    weights = write_head(tmp_path / "head", "eagle3")
    del weights["norm.weight"]
    save_file(weights, str(tmp_path / "head" / "model.safetensors"))
    config = read_head_config(tmp_path / "head", TARGET)
    with pytest.raises(ValueError, match="EAGLE head checkpoint is missing: norm.weight"):
        EagleHead(config, ReferenceAttentionBackend()).load_weights(
            head_tensors(tmp_path / "head"))
