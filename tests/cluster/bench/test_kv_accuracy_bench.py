"""`tandem bench kv-accuracy` end to end on a tiny model, and its arithmetic on known logits."""

import json
import math

import pytest
import torch

from cluster.bench.kv_accuracy import answer_agreement, compare
from cluster.bench.kv_texts import CHAT_QUESTIONS, TEXTS
from cluster.cli.main import main


def test_compare_counts_agreement_perplexity_and_kl():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), -1)
    same = compare([ref], [ref.clone()], [[7, 0, 1]])
    assert same["positions"] == 2 and same["top1_agreement"] == 1.0
    assert same["mean_kl_nats"] == 0.0 and same["perplexity_ratio"] == 1.0
    nll = -(ref[0, 0] + ref[1, 1]).item() / 2
    assert same["perplexity_reference"] == pytest.approx(math.exp(nll))
    flipped = torch.log_softmax(torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]]), -1)
    half = compare([ref], [flipped], [[7, 0, 1]])
    assert half["top1_agreement"] == 0.5 and half["perplexity_ratio"] > 1
    assert half["mean_kl_nats"] > 0


def test_answer_agreement_counts_identical_answers_and_common_prefixes():
    got = answer_agreement([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [7, 8]])
    assert got == {"answers": 3, "identical": 1, "mean_common_prefix_tokens": (3 + 1 + 1) / 3}


def test_tiny_kv_accuracy_run_writes_every_figure(tiny_models, tmp_path, capsys):
    output = tmp_path / "kv.json"
    code = main(["bench", "kv-accuracy", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--kv-cache-dtype", "int8", "fp8", "--max-tokens-per-text", "40",
                 "--chat-prompts", "2", "--chat-tokens", "6", "--block-size", "4",
                 "--output", str(output)])
    assert code == 0
    record = json.loads(output.read_text())
    # no tokenizer: seeded random ids, 40 a text, 39 positions scored in each
    assert record["texts"] == len(TEXTS) and record["tokens"] == 40 * len(TEXTS)
    assert set(record["results"]) == {"int8", "fp8"}
    for result in record["results"].values():
        assert result["positions"] == 39 * len(TEXTS)
        assert 0 < result["top1_agreement"] <= 1 and result["mean_kl_nats"] >= 0
        assert result["perplexity_reference"] > 1 and result["perplexity_quantized"] > 1
        assert result["greedy_chat"]["answers"] == 2
        assert result["greedy_chat"]["texts"] == ["", ""]  # no tokenizer: ids, no text
    assert record["chat"] == {"questions": list(CHAT_QUESTIONS[:2]), "reference": ["", ""]}
    assert "| int8 | 312 |" in capsys.readouterr().out
