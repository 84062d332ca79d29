"""workers/step_timer.py: what a step ran (prompt tokens, loaded blocks), and on a GPU the
cost of each step that computed prompt tokens or loaded blocks, on the compute stream,
reported once done and in the order the steps ran."""

import pytest
import torch

from kvstore.transfers import BlockLoad, KVTransfers, StepCost
from workers.step_input import ScheduledRequest, StepInput
from workers.step_timer import StepTimer, loaded_blocks, prompt_tokens


def make_step(*rows, loads=()):
    scheduled = [ScheduledRequest(f"r{i}", 0, new, draft_token_ids=list(drafts),
                                  num_model_drafts=model_drafts)
                 for i, (new, drafts, model_drafts) in enumerate(rows)]
    transfers = KVTransfers(loads=[BlockLoad(f"r{i}", list(blocks), list(blocks))
                                   for i, blocks in enumerate(loads)]) if loads else None
    return StepInput([], scheduled, [], transfers=transfers)


def test_prompt_tokens_are_the_rows_that_compute_more_than_a_token_and_its_drafts():
    step = make_step((1, (), 0), (3, (5, 6), 0), (4, (), 3), (40, (), 0), (7, (8,), 0))
    # a decode, a verify of 2 drafts, one of 3 model drafts: none; a prompt of 40, and 7 new
    # tokens with a draft (a chunk of 6 then its draft)
    assert prompt_tokens(step) == 47
    assert loaded_blocks(step) == 0
    assert loaded_blocks(make_step((40, (), 0), loads=[[1, 2, 3], [9]])) == 4


@pytest.mark.gpu
def test_each_prefill_step_s_cost_is_reported_once_done_in_order():
    timer = StepTimer()
    x = torch.randn(2048, 2048, device="cuda")
    for step in (make_step((64, (), 0), loads=[[1, 2]]), make_step((1, (), 0)),
                 make_step((1, (), 0), loads=[[3, 4, 5]]), make_step((32, (), 0), (1, (), 0))):
        timer.start(step)
        for _ in range(20):
            x = x @ x / 2048
        timer.stop()
    torch.cuda.synchronize()
    costs = timer.take()
    assert [(c.prompt_tokens, c.total_tokens, c.loaded_blocks) for c in costs] == [
        (64, 64, 2), (0, 1, 3), (32, 33, 0)]  # the decode step alone is not timed
    assert all(isinstance(c, StepCost) and c.seconds > 0 for c in costs)
    assert timer.take() == []
