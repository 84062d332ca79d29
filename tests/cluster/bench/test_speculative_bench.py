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


def test_w5_the_target_as_its_own_draft_model_is_right_almost_always(tiny_models, tmp_path):
    output = tmp_path / "w5-draft.json"
    assert main(["bench", "speculative", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--draft-model", str(tiny_models["llama"]), "--proposer", "draft",
                 "--batch-sizes", "1", "--k", "2", "--input-len", "8", "--output-len", "13",
                 "--output", str(output)]) == 0
    (result,) = json.loads(output.read_text())["results"]
    # float32, one model: every draft kept; 12 tokens after the prefill's in 4 verify steps
    assert result["measured_alpha"] == 1.0
    assert result["tokens_per_verify"] == 3.0
    assert result["rows_equal_to_plain"] == 1


def test_w5_an_unrelated_draft_model_pays_its_cost_while_the_oracle_proposes(tiny_models,
                                                                            tmp_path):
    output = tmp_path / "w5-oracle-draft.json"
    assert main(["bench", "speculative", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--draft-model", str(tiny_models["llama-draft"]), "--batch-sizes", "1",
                 "--k", "2", "--alpha", "1.0", "--input-len", "8", "--output-len", "13",
                 "--output", str(output)]) == 0
    (result,) = json.loads(output.read_text())["results"]
    assert result["tokens_per_verify"] == 3.0 and result["fixed_point"]
    assert result["rounds"] == 1  # float32: the plain run's tokens are the answers already


def test_w5_beside_fixed_runs_every_fixed_k_then_adaptive_in_one_engine(tiny_models, tmp_path):
    output = tmp_path / "w5-sweep.json"
    assert main(["bench", "speculative", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--batch-sizes", "2", "--k", "1,3", "--alpha", "1.0", "--beside-fixed",
                 "--repeats", "2",
                 "--input-len", "8", "--output-len", "18", "--output", str(output)]) == 0
    runs = json.loads(output.read_text())["results"]
    assert [(r["adaptive"], r["k"]) for r in runs] == [(False, 1), (False, 3), (True, 3)]
    # every draft right: fixed k 1 and 3 keep all (2 and 4 tokens a verify), and adaptive,
    # which can never verify more than 3 drafts, keeps every one it makes; whether it drafts
    # at all follows the costs it measures, wall time that a busy machine can make price a
    # verify above what it saves (a CI run: no drafts, measured alpha 0)
    assert [r["tokens_per_verify"] for r in runs[:2]] == [2.0, 4.0]
    adaptive = runs[2]
    assert adaptive["tokens_per_verify"] == 0 or adaptive["measured_alpha"] == 1.0
    assert all(r["rows_equal_to_plain"] == 2 for r in runs)


def test_w5_a_random_eagle3_head_pays_its_cost_while_the_oracle_proposes(tiny_models, tmp_path):
    output = tmp_path / "w5-eagle.json"
    assert main(["bench", "speculative", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--eagle3-head", "--batch-sizes", "1", "--k", "2", "--alpha", "1.0",
                 "--input-len", "8", "--output-len", "13", "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    (result,) = record["results"]
    assert record["draft"] == "eagle3-random"
    assert result["tokens_per_verify"] == 3.0 and result["rows_equal_to_plain"] == 1
