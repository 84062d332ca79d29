"""Our Llama-family models against HuggingFace's, in float32 on the CPU, at TP=1 and TP=2.

Each tiny model gets random weights larger than HF's init (so logits are far from zero and
differences show), is saved with save_pretrained and loaded back with our loader; a 12-token
prefill and a 1-token decode over a paged cache must give HF's full-forward logits.
"""

import re

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file

from tests.workers.gloo_group import gloo_group
from workers.attention.metadata import AttentionMetadata
from workers.attention.reference import ReferenceAttentionBackend
from workers.kv_cache import allocate_kv_caches
from workers.layers.parallel import TensorParallelGroup
from workers.loader import load_model

BLOCK_SIZE = 4
BLOCK_TABLE = [3, 1, 0, 6]  # deliberately out of order: 13 tokens span 4 blocks
NUM_BLOCKS = 8
PROMPT_LEN = 12
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
)  # fmt: skip
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
    high_freq_factor=4.0, original_max_position_embeddings=64,
)  # fmt: skip
LINEAR_ROPE = dict(rope_type="linear", rope_theta=10000.0, factor=2.0)
CASES = {
    "llama_untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama_tied_odd_vocab": ("LlamaConfig", dict(tie_word_embeddings=True, vocab_size=997)),
    "llama_biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, vocab_size=1001)),
    "llama3_rope": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, num_hidden_layers=3)),
    "linear_rope": ("LlamaConfig", dict(rope_parameters=LINEAR_ROPE)),
    "mistral": ("MistralConfig", dict(sliding_window=None, vocab_size=1001)),
    "qwen2": ("Qwen2Config", dict(vocab_size=997, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, num_hidden_layers=4)),
}
TP_CASES = {  # kv_heads=1 replicates the KV head on both ranks; odd vocabularies need padding
    "llama_biases_tied_odd": (
        "LlamaConfig",
        dict(attention_bias=True, mlp_bias=True, vocab_size=997, tie_word_embeddings=True),
    ),
    "qwen2_kv1": ("Qwen2Config", dict(num_key_value_heads=1, vocab_size=1001)),
    "qwen3_kv1": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=32, vocab_size=997)),
}  # fmt: skip


def save_tiny_model(folder, config_name: str, overrides: dict, seed: int = 0):
    """A random HF model saved in folder; returns the HF model for reference logits."""
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**TINY, **overrides})
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.15)
    hf_model.save_pretrained(folder)
    return hf_model


def metadata(start: int, end: int) -> AttentionMetadata:
    """One sequence whose tokens [start, end) are new and [0, start) already cached."""
    slots = [BLOCK_TABLE[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.tensor([BLOCK_TABLE], dtype=torch.int32),
        max_query_len=end - start,
        max_seq_len=end,
        query_lens_cpu=[end - start],
        seq_lens_cpu=[end],
    )


@torch.no_grad()
def prefill_then_decode(model, config, token_ids, tp_size: int = 1, kv_format=None,
                        key_centers=None):
    """(prefill logits (12, vocab), decode logits (1, vocab)) through a fresh paged cache, in
    kv_format (kvstore/kv_format.py; None: float32), its keys less ``key_centers``."""
    caches = allocate_kv_caches(config, tp_size, NUM_BLOCKS, BLOCK_SIZE, torch.float32,
                                torch.device("cpu"), kv_format, key_centers)
    outputs = []
    for start, end in [(0, PROMPT_LEN), (PROMPT_LEN, PROMPT_LEN + 1)]:
        hidden = model(token_ids[start:end], torch.arange(start, end), caches, metadata(start, end))
        outputs.append(model.compute_logits(hidden))
    return outputs


def prompt(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (PROMPT_LEN + 1,), generator=generator)
    ids[-1] = vocab_size - 1  # the last real row, next to the padding
    return ids


def load_ours(folder, tp=None):
    return load_model(
        folder,
        torch.float32,
        "cpu",
        tp or TensorParallelGroup.single(),
        ReferenceAttentionBackend(),
    )


@pytest.mark.parametrize("case", CASES)
def test_prefill_and_decode_match_hf(tmp_path, case):
    hf_model = save_tiny_model(tmp_path, *CASES[case])
    model, config = load_ours(tmp_path)
    ids = prompt(config.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]  # (13, vocab)
    prefill, decode = prefill_then_decode(model, config, ids)
    assert prefill.shape == (PROMPT_LEN, config.vocab_size)
    torch.testing.assert_close(prefill, expected[:PROMPT_LEN], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode, expected[PROMPT_LEN:], atol=1e-5, rtol=1e-5)


def tp_worker(rank: int, store_file: str, folders: list) -> None:
    with gloo_group(rank, 2, store_file) as tp:
        for folder in folders:
            model, config = load_ours(folder, tp)
            logits = prefill_then_decode(model, config, prompt(config.vocab_size), tp_size=2)
            torch.save(logits, f"{folder}/logits_rank{rank}.pt")


def check_tp_2_against_tp_1(tmp_path, worker) -> None:
    """Saves the TP_CASES models, runs ``worker(rank, store_file, folders)`` on two spawned
    ranks (it saves each folder's logits_rank{rank}.pt) and compares them with TP 1's plain
    layers."""
    folders = [str(tmp_path / case) for case in TP_CASES]
    for folder, (config_name, overrides) in zip(folders, TP_CASES.values(), strict=True):
        save_tiny_model(folder, config_name, overrides)
    mp.start_processes(
        worker, args=(str(tmp_path / "store"), folders), nprocs=2, start_method="spawn"
    )
    for folder in folders:
        model, config = load_ours(folder)
        expected = prefill_then_decode(model, config, prompt(config.vocab_size))
        for rank in range(2):
            got = torch.load(f"{folder}/logits_rank{rank}.pt")
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_tensor_parallel_2_matches_tp_1(tmp_path):
    check_tp_2_against_tp_1(tmp_path, tp_worker)


def test_unsupported_architecture(tmp_path):
    transformers.GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    message = (
        "unsupported architecture 'GPT2LMHeadModel' (supported: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_ours(tmp_path)


def test_folder_without_weights(tmp_path):
    transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(
        FileNotFoundError, match=f"^{re.escape(f'no *.safetensors weights in {tmp_path}')}$"
    ):
        load_ours(tmp_path)


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(f'no config.json in {tmp_path}')}$"):
        load_ours(tmp_path)


def test_missing_parameters_are_named(tmp_path):
    save_tiny_model(tmp_path, "LlamaConfig", {})
    model, _ = load_ours(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"], weights["model.layers.1.self_attn.k_proj.weight"]
    message = (
        "checkpoint is missing parameters: "
        "model.layers.1.self_attn.qkv_proj.weight, model.norm.weight"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        model.load_weights(weights.items())


def test_sliding_window_is_refused(tmp_path):
    save_tiny_model(tmp_path, "MistralConfig", dict(sliding_window=16))
    with pytest.raises(NotImplementedError, match="sliding-window attention is not supported"):
        load_ours(tmp_path)
