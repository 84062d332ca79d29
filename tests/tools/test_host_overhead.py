"""tools/profile/host_overhead.py: a real engine over the fake executor runs a load to its end
(the engine's executor protocol grew once without it, and the tool broke unnoticed)."""

import argparse

from tools.profile import host_overhead


def test_host_overhead_runs_every_request_to_its_last_token(tmp_path):
    args = argparse.Namespace(num_requests=4, prompt_len=40, output_len=6, block_size=16,
                              max_num_batched_tokens=64, outputs="delta", decode_steps=2,
                              profile=0)
    folder = host_overhead.config_only_folder(tmp_path)
    result = host_overhead.run(args, folder)
    # 160 prompt tokens at 64 a call: prompts 0-1, then 1-3 beside 0's decode, then 3's last
    # 33 beside three decodes (all four rows from the second call on); then calls of two
    # decode steps: four rows, four (the first ends after one), one: four calls hold all four
    assert (result["num_calls"], result["calls_at_batch_4"], result["decode_steps"]) == (6, 4, 2)
    assert result["host_ms_per_step_p50"] >= result["worker_ms_per_step_p50"] > 0
