"""`tandem draft-head train` end to end on a tiny chat model: questions answered by tandem,
features from transformers, a head trained and written, loaded by the engine, exact, and its
acceptance measured on held-out questions."""

import json

from cluster.cli.main import main
from cluster.engine.llm import LLM
from router.sampling_params import SamplingParams
from workers.loader import load_config
from workers.speculative.eagle.head_config import default_aux_layers, read_head_config
from workers.speculative.eagle.training import HeadShape


def test_a_head_is_trained_written_and_measured(tiny_chat_model, tmp_path, capsys):
    output = tmp_path / "head"
    assert main(["draft-head", "train", "--model", str(tiny_chat_model), "--output",
                 str(output), "--questions", "4", "--self-written", "2", "--held-out", "2",
                 "--max-tokens", "12", "--epochs", "2", "--draft-vocab", "64", "--k", "2",
                 "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["questions"] == 4 and report["self_written"] <= 2
    assert report["draft_vocab"] <= 64 and len(report["epoch_losses"]) == 2
    # k 2: each verify makes 1 to 3 tokens; per-position acceptance falls with the position
    assert 1.0 <= report["mean_accepted_length"] <= 3.0
    first, second = report["accepted_per_position"]
    assert first >= second
    # the head loads for its target (two layers: it reads the streams entering 1, 1 and 0)
    config = read_head_config(output, load_config(tiny_chat_model))
    assert config.method == "eagle3" and config.aux_layer_ids == default_aux_layers(2) == \
        (1, 1, 0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    llm = LLM(str(tiny_chat_model), device="cpu", dtype="float32")
    plain = llm.chat([{"role": "user", "content": "Why is the sky blue?"}], greedy)
    llm.engine.shutdown()
    drafted = LLM(str(tiny_chat_model), device="cpu", dtype="float32",
                  speculative_config={"method": "eagle3", "model": str(output),
                                      "num_speculative_tokens": 2})
    same = drafted.chat([{"role": "user", "content": "Why is the sky blue?"}], greedy)
    assert same[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    drafted.engine.shutdown()
    # --init: the written head trained further, its draft vocabulary kept (not --draft-vocab's)
    assert main(["draft-head", "train", "--model", str(tiny_chat_model), "--output",
                 str(tmp_path / "more"), "--init", str(output), "--questions", "2",
                 "--held-out", "0", "--max-tokens", "8", "--epochs", "1", "--draft-vocab",
                 "16", "--device", "cpu"]) == 0
    more = json.loads(capsys.readouterr().out)
    assert more["draft_vocab"] == report["draft_vocab"] and len(more["epoch_losses"]) == 1
    assert read_head_config(tmp_path / "more", load_config(tiny_chat_model)).draft_vocab_size \
        == report["draft_vocab"]


def test_a_head_has_the_targets_layer_shape_and_a_capped_vocabulary():
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0)
    shape = HeadShape.for_target(target, draft_vocab_size=8192)
    assert (shape.head_dim, shape.aux_layer_ids, shape.draft_vocab_size) == (64, (2, 15, 27),
                                                                               8192)
    assert shape.rope_theta == 100000.0


def test_training_noise_is_a_share_of_the_features_overall_spread(capsys):
    import torch

    from cluster.draft_head import with_noise

    # dimension 2 is a massive activation: the overall spread is ~its own
    features = torch.tensor([[5.0, -1.0, 20000.0], [5.0, 1.0, 0.0]])
    torch.manual_seed(0)
    noisy = with_noise(features, 0.1)
    torch.manual_seed(0)
    draws = torch.randn(2, 3)
    assert torch.equal(noisy, features + 0.1 * features.std() * draws)
    assert with_noise(features, 0.0) is features
    assert main(["draft-head", "train", "--output", "unused", "--noise", "-0.1"]) == 2
    assert capsys.readouterr().err == "tandem: error: --noise must be at least 0, got -0.1\n"


def test_the_learning_rate_follows_one_cycle_by_progress():
    import pytest

    from cluster.draft_head import one_cycle

    assert one_cycle(0.0, 1.0) == pytest.approx(1 / 25)
    assert one_cycle(0.05, 1.0) == pytest.approx((1 / 25 + 1) / 2)
    assert one_cycle(0.1, 1.0) == pytest.approx(1.0)
    assert one_cycle(0.55, 1.0) == pytest.approx((1 + 1 / 25e4) / 2)
    assert one_cycle(1.0, 1.0) == pytest.approx(1 / 25e4)


def test_a_spent_time_limit_ends_training_before_a_step(monkeypatch):
    import itertools
    import types

    import torch

    import cluster.draft_head as draft_head

    # started at 0, then every check at 5: the limit is spent before the first step
    clock = itertools.chain([0.0], itertools.repeat(5.0))
    monkeypatch.setattr(draft_head.time, "monotonic", lambda: next(clock))

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.shape = types.SimpleNamespace(aux_layer_ids=(0,))
            self.draft_ids = torch.arange(4)

    examples = [draft_head.Example(torch.arange(4), 2)]
    means = draft_head.train_head(examples, None, Head(), epochs=2, steps=1, lr=1e-3,
                                  device=torch.device("cpu"), seed=0, time_limit=5.0)
    assert means == []  # no step ran: the teacher (None here) was never called


def test_train_seconds_must_be_positive(tmp_path, capsys):
    assert main(["draft-head", "train", "--output", str(tmp_path / "head"),
                 "--train-seconds", "0"]) == 2
    assert capsys.readouterr().err == "tandem: error: --train-seconds must be above 0, got 0.0\n"
    assert not (tmp_path / "head").exists()

