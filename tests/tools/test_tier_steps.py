"""tools/profile/tier_steps.py: a tiers run's engine steps timed by part and grouped by the
copies each step's message carried."""

import collections

import pytest
import torch

from router.scheduler import Scheduler
from tools.profile import tier_steps
from tools.profile.tier_steps import LOADED, PROMPT, STORED
from workers.step_input import ScheduledRequest, StepInput


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
            assert all(row[part] == 0 for part in tier_steps.DEVICE_PARTS)
    assert Scheduler.__dict__["schedule"] is schedule  # patched only while it ran
    capsys.readouterr()


class ClockEvent:
    """A CUDA event on the CPU: recording it ticks a clock of 1 ms a record."""

    ticks = 0

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        ClockEvent.ticks += 1
        self.at = ClockEvent.ticks

    def synchronize(self) -> None:
        assert self.at is not None

    def elapsed_time(self, end: "ClockEvent") -> float:
        return float(end.at - self.at)


def test_a_gpu_step_s_device_time_is_split_at_its_copies_and_its_forward(monkeypatch):
    monkeypatch.setattr(tier_steps.torch.cuda, "Event", ClockEvent)
    parts = tier_steps.StepParts()
    before = parts._marked(lambda: ClockEvent.record(ClockEvent(True)), after=True)
    after = parts._marked(lambda: None, after=False)

    def execute(worker_, step):  # copies (one more tick), a forward of two ticks, stores
        before()
        ClockEvent.ticks += 2
        after()

    class GpuWorker:
        device = torch.device("cuda")

    timed = parts._on_device(execute)
    parts.current = collections.defaultdict(float)
    timed(GpuWorker(), StepInput([], [ScheduledRequest("a", 0, 5)], []))
    step = parts.current
    parts.read_device_times()
    # start at 1, the copies' extra tick at 2, copies done at 3, forward done at 6, end at 7
    assert step[PROMPT] == 5
    assert step[tier_steps.DEVICE] == pytest.approx(6e-3)
    assert [step[part] for part in tier_steps.DEVICE_PARTS] == pytest.approx(
        [2e-3, 3e-3, 1e-3])
    # a step without the offloader's calls (no tiers) keeps its events to none
    parts.current = collections.defaultdict(float)
    parts._on_device(lambda worker_, step: None)(GpuWorker(), StepInput([], [], []))
    assert parts._device_spans == []
