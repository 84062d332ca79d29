"""The rejection sampler is exact: what it emits is distributed as the target's own samples.

A toy "model" is a Markov chain over a small vocabulary: the target's next-token distribution
depends on the last token only (a table P), the draft's too (another table Q). Two steps of
draft-and-verify give a joint distribution of the first two emitted tokens that a chi-square
test compares with P's own: P(s)(x1) * P(x1)(x2)."""

import math

import pytest
import torch

from workers.sampler import SamplingSpec, target_probs
from workers.speculative.ngram import ngram_drafts
from workers.speculative.rejection import verify

V, ROWS, START = 5, 200_000, 0


def chi_square_critical(df: int) -> float:
    """The 99.9% point of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    z = 3.090
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def tables(seed: int, spec: SamplingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = target_probs(torch.randn(V, V, generator=g) * 2, [spec] * V)  # (V, V): P[prev]
    draft = torch.randn(V, V, generator=g).softmax(dim=1)  # an unrelated draft
    return target, draft


def draft_and_verify(target, draft, starts, k, g):
    """One step for every row: k draft tokens from Q, then verify against P."""
    rows = len(starts)
    drafts, q, prev = [], [], starts
    for _ in range(k):
        probs = draft[prev]
        token = torch.multinomial(probs, 1, generator=g).squeeze(1)
        drafts.append(token), q.append(probs)
        prev = token
    draft_ids = torch.stack(drafts, dim=1)
    contexts = torch.cat([starts.unsqueeze(1), draft_ids], dim=1)  # p_j follows token j
    p = target[contexts]  # (rows, k+1, V)
    return verify(p, draft_ids, torch.full((rows,), k), torch.stack(q, dim=1), [None] * rows,
                  shared=g)


@pytest.mark.parametrize("spec", [
    SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.5),
    SamplingSpec(temperature=1.3, top_k=3), SamplingSpec(temperature=0.8, top_p=0.7),
    SamplingSpec(temperature=0.0),
])
def test_first_two_tokens_follow_the_target_exactly(spec):
    target, draft = tables(1, spec)
    g = torch.Generator().manual_seed(2)
    starts = torch.full((ROWS,), START)
    tokens, counts = draft_and_verify(target, draft, starts, 2, g)
    first = tokens[:, 0]
    second = tokens[:, 1].clone()
    short = counts == 1  # one token only: the second comes from the next step
    more, _ = draft_and_verify(target, draft, first[short], 2, g)
    second[short] = more[:, 0]
    observed = torch.bincount(first * V + second, minlength=V * V).double()
    expected = (target[START].unsqueeze(1) * target).reshape(-1).double() * ROWS
    cells = expected > 0
    assert observed[~cells].sum() == 0  # nothing the target cannot emit (top-k, greedy)
    statistic = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum().item()
    assert statistic < chi_square_critical(max(int(cells.sum()) - 1, 1))


def test_the_bonus_token_follows_the_target_after_the_last_draft():
    spec = SamplingSpec(temperature=1.0)
    target, _ = tables(3, spec)
    g = torch.Generator().manual_seed(4)
    starts = torch.full((ROWS,), START)
    tokens, counts = draft_and_verify(target, target, starts, 1, g)  # draft = target
    assert counts.tolist() == [2] * ROWS  # accepts all: u * q < p with q == p
    bonus = tokens[tokens[:, 0] == 2, 1]  # after the draft token 2: P[2]
    observed = torch.bincount(bonus, minlength=V).double()
    expected = target[2].double() * len(bonus)
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    assert statistic < chi_square_critical(V - 1)


def test_disjoint_supports_accept_nothing_and_a_greedy_row_takes_the_argmax():
    p = torch.tensor([[[0.0, 0.7, 0.3, 0.0], [0.25] * 4, [0.25] * 4]])  # the target's
    q = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]])  # only token 3, then 0
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens, counts = verify(p, torch.tensor([[3, 0]]), torch.tensor([2]), q, [None], g)
        assert counts.tolist() == [1] and tokens[0, 0].item() in (1, 2)
        assert tokens[0, 1:].tolist() == [-1, -1]
    greedy = target_probs(torch.tensor([[0.0, 5.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0],
                                        [0.0, 0.0, 0.0, 9.0]]), [SamplingSpec(temperature=0.0)] * 3)
    drafts = torch.tensor([[1, 2]])  # 1 is the argmax, 2 is not (0 is): keep 1, then 0
    tokens, counts = verify(greedy.unsqueeze(0), drafts, torch.tensor([2]), None, [None], g)
    assert (tokens.tolist(), counts.tolist()) == ([[1, 0, -1]], [2])
    tokens, counts = verify(greedy.unsqueeze(0), torch.tensor([[1, 0]]), torch.tensor([2]),
                            None, [None], g)
    assert (tokens.tolist(), counts.tolist()) == ([[1, 0, 3]], [3])  # all kept, and a bonus
    tokens, counts = verify(greedy.unsqueeze(0), torch.tensor([[1, 0]]), torch.tensor([1]),
                            None, [None], g)
    assert (tokens.tolist(), counts.tolist()) == ([[1, 0, -1]], [2])  # its one draft, a bonus


def test_seeded_rows_repeat_whatever_else_is_in_the_batch():
    target, draft = tables(5, SamplingSpec(temperature=1.0))
    p = target[torch.tensor([[0, 1, 2], [3, 4, 0]])]
    q = draft[torch.tensor([[0, 1], [3, 4]])]
    ids = torch.tensor([[1, 2], [4, 0]])
    runs = []
    for other_seed in (7, 8):
        own = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(other_seed)]
        tokens, counts = verify(p, ids, torch.tensor([2, 2]), q, own)
        runs.append((tokens[0].tolist(), counts[0].item()))
    assert runs[0] == runs[1]


def test_ngram_takes_what_followed_the_latest_longest_match():
    assert ngram_drafts([1, 2, 3, 4, 9, 1, 2, 3], 3, 1, 4) == [4, 9, 1]
    assert ngram_drafts([5, 1, 2, 7, 1, 2], 2, 1, 3) == [7, 1]  # "1 2" matched, then "7 1"
    assert ngram_drafts([5, 6, 7, 8], 4, 1, 3) == []  # no earlier occurrence
    assert ngram_drafts([3, 1, 3, 2, 3], 2, 1, 1) == [2, 3]  # the latest "3" is at 2
    assert ngram_drafts([1, 2, 1, 2], 5, 2, 2) == [1, 2]  # cut at the end of what is known
    assert ngram_drafts([4, 4], 3, 2, 4) == []  # shorter than min_n + 1


def test_greedy_verification_from_argmaxes_equals_the_one_hot_verify():
    from workers.speculative.rejection import verify_greedy

    torch.manual_seed(3)
    batch, k, vocab = 256, 4, 7
    argmax = torch.randint(0, vocab, (batch, k + 1))
    # drafts equal to the argmax with probability ~1/2 each, so every accepted length occurs
    wrong = torch.randint(1, vocab, (batch, k))
    draft_ids = torch.where(torch.rand(batch, k) < 0.5, argmax[:, :k], (argmax[:, :k] + wrong)
                            % vocab)
    num_drafts = torch.randint(0, k + 1, (batch,))
    one_hot = torch.zeros(batch, k + 1, vocab).scatter_(2, argmax.unsqueeze(2), 1.0)
    expected = verify(one_hot, draft_ids, num_drafts, None, [None] * batch,
                      torch.Generator().manual_seed(0))
    tokens, counts = verify_greedy(argmax, draft_ids, num_drafts)
    assert torch.equal(tokens, expected[0]) and torch.equal(counts, expected[1])
    assert set(counts.tolist()) == {1, 2, 3, 4, 5}
