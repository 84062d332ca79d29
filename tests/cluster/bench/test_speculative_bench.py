"""`tandem bench speculative` (W5) on a tiny model: the oracle's acceptance and its theory."""

import json

import pytest

from cluster.bench.speculative import theory
from cluster.cli.main import main


def test_theory_of_tokens_per_verify_step():
    assert theory(1.0, 4) == 5.0
    assert theory(0.5, 2) == pytest.approx(1.75)
    assert theory(0.0, 3) == 1.0


def test_w5_all_right_drafts_keep_every_one_and_the_same_tokens(tiny_models, tmp_path):
    output = tmp_path / "w5.json"
    assert main(["bench", "speculative", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--batch-sizes", "2", "--k", "3", "--alpha", "1.0,0.0", "--input-len", "8",
                 "--output-len", "18", "--output", str(output)]) == 0
    right, wrong = json.loads(output.read_text())["results"]
    # 17 tokens after the prefill's: 4 verify steps of 3 drafts, then the last one alone
    assert right["tokens_per_verify"] == 4.0
    assert wrong["tokens_per_verify"] == 1.0  # every draft rejected: one token a step
    assert right["rows_equal_to_plain"] == wrong["rows_equal_to_plain"] == 2
