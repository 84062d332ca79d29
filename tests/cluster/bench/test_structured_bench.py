"""`tandem bench structured` on a tiny model given the default model's tokenizer: every row
under the JSON schema, the same rows unconstrained for as many tokens, the TTFT a cached
grammar adds and the corpus's cold compiles."""

import json

from cluster.bench.structured import MIN_ITEMS, SCHEMA, with_tokenizer
from cluster.bench.structured_corpus import corpus
from cluster.cli.main import main


def test_rows_under_a_schema_beside_the_same_rows_unconstrained(tiny_models, tmp_path):
    output = tmp_path / "structured.json"
    assert main(["bench", "structured", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--batch-sizes", "3", "--prompt-len", "8", "--output-len", "40",
                 "--repeats", "1", "--ttft-samples", "2", "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    (result,) = record["results"]
    # nothing lets the array close before MIN_ITEMS numbers: every row runs to its length
    assert MIN_ITEMS * 2 > 40
    assert result["batch"] == 3 and result["output_tokens"] == 3 * 40
    assert result["answers_ended"] == result["answers_valid"] == 0
    assert result["first_answer"].startswith('{"name": "')
    assert result["plain_tokens_per_s"] > 0 and result["structured_tokens_per_s"] > 0
    assert record["ttft"]["samples"] == 2
    assert record["cold_compiles"]["specs"] == len(corpus())
    assert record["schema"] == SCHEMA


def test_a_shape_gets_a_tokenizer_in_a_folder_beside_it(tiny_models, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for path in tiny_models["llama"].iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "tokenizer_config.json").write_text("{}")
    folder = with_tokenizer(model, tokenizer)
    assert folder == tmp_path / "model-tokenizer-tok"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [p.name for p in model.iterdir()] + ["tokenizer.json", "tokenizer_config.json"])
    assert (folder / "model.safetensors").is_symlink()
    assert with_tokenizer(model, tokenizer) == folder  # made once
