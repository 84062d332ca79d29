"""The worker's half of a verify step: the kept tokens of each row, read to the host in one
copy (each row's count is where its -1s start), whether its logits are the rows themselves
or are gathered from a step with plain rows among them."""

from types import SimpleNamespace

import torch

from workers.sampler import SamplingSpec
from workers.speculative.verify_step import PendingTokens, verify_rows

GREEDY = SimpleNamespace(spec=SamplingSpec(temperature=0.0))


def logits_of(argmaxes: list[int], vocab: int = 11) -> torch.Tensor:
    """(len, vocab) logits whose row i peaks at ``argmaxes[i]``."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    return logits.scatter_(1, torch.tensor(argmaxes).unsqueeze(1), 10.0)


def test_each_row_keeps_its_agreed_drafts_and_one_token_more():
    # row a: drafts 3, 4, 5 against argmaxes 3, 4, 9 | 6 (two kept, then the target's 9);
    # row b: drafts 1, 2, 0 against argmaxes 1, 2, 0 | 8 (all kept, and the bonus 8)
    logits = logits_of([3, 4, 9, 6, 1, 2, 0, 8])
    pending = verify_rows(logits, [0, 4], [[3, 4, 5], [1, 2, 0]], [GREEDY, GREEDY], None)
    assert pending.result() == [[3, 4, 9], [1, 2, 0, 8]]


def test_rows_gathered_from_a_step_with_plain_rows_keep_the_same_tokens():
    # the same two rows with a plain row's logits (argmax 7) between them
    logits = logits_of([3, 4, 9, 6, 7, 1, 2, 0, 8])
    pending = verify_rows(logits, [0, 5], [[3, 4, 5], [1, 2, 0]], [GREEDY, GREEDY], None)
    assert pending.result() == [[3, 4, 9], [1, 2, 0, 8]]


def test_a_row_s_count_is_where_its_minus_ones_start():
    tokens = torch.tensor([[5, -1, -1], [5, 6, 7], [0, 4, -1]])
    assert PendingTokens(tokens, None).result() == [[5], [5, 6, 7], [0, 4]]
