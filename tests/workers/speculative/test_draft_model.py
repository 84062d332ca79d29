"""The draft model drafts only when asked, and catches its K/V up in one forward over the
tokens it missed: with the target as its own draft, its drafts are the target's greedy
tokens (transformers'), however long it paused and whatever was accepted."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.speculative.device_drafts import DeviceDrafts
from workers.speculative.draft_follower import DraftState
from workers.speculative.draft_model import Drafted, DraftModel
from workers.worker_config import make_attention_backend

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 8, 9, 10, 11, 12] * 3]
BLOCK = 4


@pytest.fixture(scope="module")
def greedy(tiny_models):
    """transformers' greedy continuation of ``tokens``, ``n`` tokens long."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)

    def continuation(tokens: list[int], n: int) -> list[int]:
        out = hf.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(tokens), dtype=torch.long))
        return out[0, len(tokens):].tolist()

    return continuation


class Counting:
    """The draft's model, counting the tokens of each forward."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.model, self.forwards, self.query_lens = model, [], []

    def __call__(self, input_ids, positions, kv_caches, meta):  # type: ignore[no-untyped-def]
        self.forwards.append(input_ids.numel())
        self.query_lens.append(meta.max_query_len)  # 1: one-token rows (graphed on a GPU)
        return self.model(input_ids, positions, kv_caches, meta)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self.model, name)


@pytest.fixture
def draft(tiny_models):
    cpu = torch.device("cpu")
    model = DraftModel(str(tiny_models["llama"]), torch.float32, cpu,
                       make_attention_backend("reference", cpu), num_drafts=4, block_size=BLOCK)
    model.allocate(64)
    model.build_rotary_table(256)
    model.model = Counting(model.model)
    return model


def states():
    # blocks 1-12 for the first request, 13-24 for the second (block 0 is never used)
    return [DraftState(list(p), list(range(1 + 12 * i, 13 + 12 * i)))
            for i, p in enumerate(PROMPTS)]


def test_drafts_after_a_pause_catch_up_in_one_forward(draft, greedy):
    first, second = states()
    a, b = greedy(PROMPTS[0], 12), greedy(PROMPTS[1], 4)
    # new to the draft: one forward over each whole prompt, then one-token steps
    assert draft.draft(["a", "b"], [first, second], [3, 1]) == [a[:3], b[:1]]
    assert draft.model.forwards == [len(PROMPTS[0]) + len(PROMPTS[1]), 1, 1]
    # a's three drafts were accepted with the bonus token, then it decoded 4 plain steps
    # without the draft; b's one draft was accepted with the bonus
    first.token_ids += a[:8]
    second.token_ids += b[:2]
    draft.model.forwards.clear()
    assert draft.draft(["a", "b"], [first, second], [4, 2]) == [a[8:12], b[2:4]]
    # a's K/V was right through its third draft step (position 11): the forward covers
    # positions 12-17; b's through its draft's step (18): 18-19. Then the one-token steps
    assert draft.model.forwards == [6 + 2, 2, 1, 1]


def test_a_rejected_draft_leaves_the_row_in_step_and_a_released_one_starts_again(draft,
                                                                                   greedy):
    [first, _] = states()
    d1, d2 = greedy(PROMPTS[0], 2)
    assert draft.draft(["a"], [first], [2]) == [[d1, d2]]
    assert draft.take_caught_up() == len(PROMPTS[0])  # its prompt, what a step reports
    assert draft.take_caught_up() == 0
    first.token_ids += [d1, (d2 + 1) % 1000]  # the first accepted, the second rejected
    draft.model.forwards.clear()
    assert draft.draft(["a"], [first], [2]) == [greedy(first.token_ids, 2)]
    assert draft.model.forwards == [1, 1]  # in step: its newest token alone, then a step
    assert draft.take_caught_up() == 1
    draft.release(["a"])  # preempted: back with blocks the draft never wrote
    first.block_ids = list(range(30, 42))
    draft.model.forwards.clear()
    assert draft.draft(["a"], [first], [1]) == [greedy(first.token_ids, 1)]
    assert draft.model.forwards == [len(first.token_ids)]


def test_a_row_a_few_tokens_behind_catches_up_as_one_token_rows(draft, greedy):
    first, second = states()
    a, b = greedy(PROMPTS[0], 7), greedy(PROMPTS[1], 3)
    assert draft.draft(["a", "b"], [first, second], [3, 2]) == [a[:3], b[:2]]
    first.token_ids += a[:4]  # all three accepted, and the bonus: positions 12 and 13 unseen
    second.token_ids += [b[0], (b[1] + 1) % 1000]  # the second rejected: 19 (its newest) unseen
    b = greedy(second.token_ids, 2)
    draft.model.forwards.clear()
    draft.model.query_lens.clear()
    assert draft.draft(["a", "b"], [first, second], [3, 2]) == [a[4:7], b]
    assert draft.model.forwards == [2 + 1, 2, 1]
    assert draft.model.query_lens == [1, 1, 1]  # decode rows, not an eager prefill


def test_which_positions_stay_valid_after_a_verify():
    # drafted at 10 tokens: its steps wrote positions 9-11
    drafted = Drafted(10, DeviceDrafts(torch.tensor([[5, 6, 7]]), [3]), 0)
    tokens = list(range(10))
    assert drafted.valid_positions(tokens + [5, 6, 7, 8]) == 12  # all kept, and the bonus
    assert drafted.valid_positions(tokens + [5, 6, 9]) == 12  # the 3rd rejected
    assert drafted.valid_positions(tokens + [5, 9]) == 11
    assert drafted.valid_positions(tokens + [9]) == 10  # none kept: its own newest only
