"""tools/profile/tier_steps.py: a tiers run's engine steps timed by part and grouped by the
copies each step's message carried."""

import collections

import pytest

from router.scheduler import Scheduler
from tools.profile import tier_steps
from tools.profile.tier_steps import LOADED, PROMPT, STORED


def test_steps_are_grouped_by_their_copies_and_prompt_tokens_with_mean_ms_by_part():
    steps = [collections.defaultdict(float, d) for d in (
        {"step": 0.004, "forward": 0.002, LOADED: 8, PROMPT: 16},
        {"step": 0.003, "forward": 0.002, STORED: 4, PROMPT: 32},
        {"step": 0.002, "forward": 0.001, STORED: 4},
        {"step": 0.001, "forward": 0.001})]
    table = tier_steps.by_kind(steps)
    assert list(table) == ["all", "loads", "prefill", "decode, stores", "decode"]
    assert table["all"]["steps"] == 4 and table["all"]["blocks a step"] == 4
    assert table["all"]["step"] == pytest.approx(10 / 4)
    assert table["all"][PROMPT] == 12
    assert table["loads"]["blocks a step"] == 8 and table["loads"]["step"] == pytest.approx(4)
    assert table["prefill"][PROMPT] == 32 and table["prefill"]["blocks a step"] == 4
    assert table["decode, stores"]["forward"] == pytest.approx(1)
    assert table["decode"]["blocks a step"] == 0 and table["decode"]["loads"] == 0


def test_a_tiny_tiers_run_times_the_host_tiers_loads_and_restores_every_method(
        tiny_models, tmp_path, capsys):
    schedule = Scheduler.__dict__["schedule"]
    tables = tier_steps.run([
        "--model", str(tiny_models["llama"]), "--device", "cpu", "--dtype", "float32",
        "--no-hf", "--num-groups", "4", "--group-size", "2", "--prefix-len", "64",
        "--question-len", "8", "--output-len", "2", "--pass-major", "--num-kv-blocks", "32",
        "--block-size", "4", "--host-kv-cache-gb", "0.001", "--max-num-seqs", "4",
        "--output", str(tmp_path / "run.json")])
    assert list(tables) == ["recompute", "host"]
    assert set(tables["recompute"]) == {"all", "prefill", "decode"}  # no tier, no copies
    assert tables["recompute"]["prefill"][PROMPT] >= 8  # a question at least
    assert tables["recompute"]["decode"][PROMPT] == 0
    host = tables["host"]
    # the repeats' prefixes (16 blocks each) come back from the host tier
    assert host["loads"]["steps"] >= 1 and host["loads"]["blocks a step"] >= 16
    assert host["loads"]["loads"] > 0
    assert host["prefill"]["stores"] + host["decode, stores"]["stores"] > 0
    for kinds in tables.values():
        for row in kinds.values():
            assert row["step"] >= row["forward"] > 0
            assert row["device"] == 0  # the CPU: no CUDA events
    assert Scheduler.__dict__["schedule"] is schedule  # patched only while it ran
    capsys.readouterr()
