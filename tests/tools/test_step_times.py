"""tools/profile/step_times.py: an offline run's calls counted by kind, and the device's idle
time before each kind from events on its clock."""

import pytest

from cluster.bench import workloads
from cluster.engine.llm import LLM
from tools.profile import step_times


def test_step_times_device_idle_between_calls_on_the_device_clock():
    # event times in ms: call 1 ends at 10; call 2's start is passed at 10 (work was queued:
    # no idle), ends at 30; call 3 starts at 34 (4 ms idle); a profiled call breaks the chain
    # (the 40 ms around it are not idle time); the last call waited 2.5 ms
    marks = [("prefill", 0.0, 10.0), ("decode x8", 10.0, 30.0), ("decode x8", 34.0, 50.0),
             None, ("decode x8", 90.0, 99.0), ("prefill", 101.5, 120.0)]
    assert step_times.idle_before(marks, lambda a, b: b - a) == pytest.approx(
        {"decode x8": 0.004, "prefill": 0.0025})


def test_step_times_counts_calls_by_kind_and_decode_calls_by_batch(tiny_models):
    assert [step_times.batch_bucket(n) for n in (1, 8, 9, 130, 256, 300)] == [
        "<= 8", "<= 8", "<= 16", "<= 192", "<= 256", "> 256"]
    llm = LLM(model=str(tiny_models["llama"]), device="cpu", num_kv_blocks=64, decode_steps=4,
              max_num_batched_tokens=64)
    requests = [workloads.Request([1, 2, 3], 9), workloads.Request([4] * 10, 5)]
    traced = step_times.trace(llm, requests)
    kinds = traced["kinds"]
    # one prefill call for both prompts (a token each), then calls of 4 decode steps: the
    # first for both (the 5-token request ends there), the second for the 9-token one alone
    assert {name: (kind["calls"], kind["seqs"], kind["tokens"]) for name, kind in kinds.items()} \
        == {"prefill (with decodes)": (1, 2, 13), "decode x4": (2, 3, 12)}
    assert {bucket: by["calls"] for bucket, by in traced["decode_calls_by_batch"].items()} == {
        "<= 8": 2}
    # context read: the prompts (3 + 10); then step s of a row with c computed reads c + 1 + s:
    # (4..7) + (11..14) in the first decode call, (8..11) in the second
    assert kinds["prefill (with decodes)"]["context_tokens"] == 13
    assert kinds["decode x4"]["context_tokens"] == 22 + 50 + 38
    kv_bytes = step_times.kv_bytes_per_token(llm.engine)
    assert kinds["decode x4"]["kv_gb_read"] == 110 * kv_bytes / 1e9 and kv_bytes > 0
