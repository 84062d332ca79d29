"""The vocabulary split across tensor-parallel ranks, every rank in one process: each rank's
collective is stood in for (its share of the sum, its slice of the gather), and the ranks'
shares put together must be the unsharded embedding rows (exactly) and logits."""

import pytest
import torch

from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding, padded_vocab_size

HIDDEN = 8


class OneRank:
    """Rank ``rank`` of ``size``: all_reduce returns its own share (the test sums the ranks'),
    all_gather puts its tensor among ``shares``, the other ranks' (as they would send them)."""

    def __init__(self, rank: int, size: int, shares: list | None = None) -> None:
        self.rank, self.size, self.shares = rank, size, shares

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        assert self.shares is not None
        return torch.cat([t if r == self.rank else s for r, s in enumerate(self.shares)], dim)


def padding_ranks(vocab_size: int, tp_size: int) -> list[int]:
    local = padded_vocab_size(vocab_size, tp_size) // tp_size
    return [r for r in range(tp_size) if r * local >= vocab_size]


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_ranks_of_padding_alone_load_nothing_and_the_shards_give_exact_rows_and_logits(tp_size):
    """517 tokens (below 64 * tp * (tp - 1) at TP 4 and 8): rank 3 of 4 and ranks 5-7 of 8 own
    rows past the vocabulary only. They load none, look no id up, and score zeros that the
    gather cuts off; the other ranks' real rows are the checkpoint's."""
    vocab_size = 517
    assert padding_ranks(vocab_size, tp_size) == {2: [], 4: [3], 8: [5, 6, 7]}[tp_size]
    generator = torch.Generator().manual_seed(tp_size)
    weight = torch.randn(vocab_size, HIDDEN, generator=generator)
    ids = torch.tensor([0, 5, 191, 192, 383, 384, 511, 512, 515, 516])  # rank edges, the last
    hidden = torch.randn(3, HIDDEN, generator=generator)
    local_logits: list = []  # every rank's (3, V_local) scores, as all_gather collects them
    rows, heads = 0, []
    for rank in range(tp_size):
        tp = OneRank(rank, tp_size, local_logits)
        embedding = VocabParallelEmbedding(vocab_size, HIDDEN, tp)  # type: ignore[arg-type]
        head = ParallelLMHead(vocab_size, HIDDEN, tp)  # type: ignore[arg-type]
        for layer in (embedding, head):
            layer.weight.data.fill_(float("nan"))  # torch.empty's leftovers: all overwritten
            layer.weight.weight_loader(layer.weight, weight)
        assert torch.equal(embedding.weight, head.weight)
        rows = rows + embedding(ids)  # all_reduce: the ranks' rows summed
        local_logits.append(torch.nn.functional.linear(hidden, head.weight))
        heads.append(head)
    padded = torch.cat([head.weight for head in heads])  # rank r's rows: r * V_local ...
    assert padded.shape == (padded_vocab_size(vocab_size, tp_size), HIDDEN)
    assert torch.equal(padded[:vocab_size], weight)
    assert not padded[vocab_size:].any()  # padding rows are zero on every rank
    assert torch.equal(rows, weight[ids])
    assert not torch.cat(local_logits, dim=-1)[:, vocab_size:].any()  # padding scores zero
    logits = [head.compute_logits(hidden) for head in heads]  # each rank's gathered logits
    assert all(torch.equal(got, logits[0]) for got in logits)
    assert logits[0].shape == (3, vocab_size)  # the padding cut off: never sampled
    torch.testing.assert_close(logits[0], hidden @ weight.T)


def test_a_checkpoint_tensor_of_another_shape_is_refused_on_every_rank():
    """A rank of padding alone copies no row, but still checks the tensor it was given."""
    for rank in range(4):
        embedding = VocabParallelEmbedding(517, HIDDEN, OneRank(rank, 4))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^checkpoint tensor has shape \(516, 8\), "
                           r"expected \(517, 8\)$"):
            embedding.weight.weight_loader(embedding.weight, torch.zeros(516, HIDDEN))
