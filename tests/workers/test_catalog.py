import json
import os

import numpy as np
import pytest

from cluster import environment
from cluster.cli.main import main as tandem
from workers import catalog
from workers.catalog import CATALOG, DEFAULT_MODEL, ChecksumError, resolve_model
from workers.catalog.gguf_import import hf_tensor_name, unpermute_rotary
from workers.catalog.wheels import file_sha256, read_pins, verify_sha256


def test_unknown_model_error_names_the_catalog():
    known = ("smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, "
             "smollm2-135m-instruct-eagle3")  # the catalog's models, then the shipped heads
    expected = f"unknown model 'xyz': not a folder and not in the catalog (known: {known})"
    with pytest.raises(ValueError) as error:
        resolve_model("xyz")
    assert str(error.value) == expected


def test_resolve_model_returns_an_existing_folder_as_is(tmp_path):
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_sha256_mismatch_raises_a_clear_error(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a model")
    actual = file_sha256(fake)
    verify_sha256(actual, actual, fake)  # a match passes silently
    with pytest.raises(ChecksumError, match=r"sha256 mismatch for fake\.gguf: expected 0{64}"):
        verify_sha256(actual, "0" * 64, fake)


def test_pins_file_holds_exactly_the_catalog_pins_each_hashed():
    pins = read_pins()
    catalog_requirements = {req for entry in CATALOG.values() for req in entry.requirements}
    assert set(pins) == catalog_requirements
    for line in pins.values():
        assert len(line.split("--hash=sha256:")[1]) == 64, line


def test_pull_is_a_no_op_when_the_folder_exists(tmp_path):
    folder = tmp_path / "models" / DEFAULT_MODEL
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert catalog.is_pulled(DEFAULT_MODEL, tmp_path)
    assert catalog.pull(DEFAULT_MODEL, tmp_path) == folder


def test_list_models_puts_the_default_first():
    names = [entry.name for entry in catalog.list_models()]
    assert names[0] == DEFAULT_MODEL and sorted(names) == sorted(CATALOG)


def test_tensor_names_map_to_hf():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    with pytest.raises(ValueError, match="unsupported GGUF tensor"):
        hf_tensor_name("blk.0.attn_qkv.weight")


def test_unpermute_rotary_inverts_llama_cpp_permute():
    num_heads, head_dim, hidden = 3, 8, 5
    weight = np.arange(num_heads * head_dim * hidden, dtype=np.float32).reshape(-1, hidden)
    # convert_hf_to_gguf's permute: per head, rows (2, head_dim/2) -> (head_dim/2, 2).
    permuted = (
        weight.reshape(num_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    )
    assert np.array_equal(unpermute_rotary(permuted, num_heads), weight)


def test_cli_rejects_an_unknown_model(capsys):
    assert tandem(["models", "path", "xyz"]) == 2
    assert "unknown model 'xyz'" in capsys.readouterr().err


def test_cli_lists_the_catalog(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert tandem(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "ARCHITECTURE", "PARAMS", "GGUF", "PULLED"]
    assert lines[1].split()[:3] == [DEFAULT_MODEL, "(default)", "LlamaForCausalLM"]
    assert all(line.endswith("no") for line in lines[1:])


@pytest.mark.slow
def test_pull_default_model_converts_to_a_hf_folder():
    # Uses $TANDEM_CACHE_DIR or the default cache, so CI downloads the model once.
    folder = catalog.pull(DEFAULT_MODEL, environment.cache_dir())
    assert catalog.pull(DEFAULT_MODEL, environment.cache_dir()) == folder  # second pull: no-op
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    staging_prefix = f".{DEFAULT_MODEL}."
    assert not any(name.startswith(staging_prefix) for name in os.listdir(folder.parent))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
