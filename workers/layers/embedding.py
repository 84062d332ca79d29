"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

When sharded, the vocabulary is padded up to a multiple of 64 * tp (every rank's shard a
multiple of 64 rows), so vocabularies such as 49,153 still shard evenly. At tp = 1 it is not
padded: the LM head matmul then has exactly HF's shape, and CPU BLAS rounds a matrix-vector
product of 997 rows differently from one of 1024, so padding would cost bit-exact decode
logits. Rank r owns padded rows [r * V_local, (r + 1) * V_local); padding rows are zero and
never reach the caller::

    rows:    [ rank 0 | rank 1 | ... | rank tp-1 ]
    ids:     [ 0 .......................... V-1 | padding ]

A small vocabulary can leave the last ranks nothing but padding (V = 517 at tp = 4: 192 rows a
rank, rank 3's rows 576-767 are all padding; at tp = 8 ranks 5-7): such a rank loads no row,
looks no id up, and its all-zero logits are cut off after the gather.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.layers.batch_invariant import invariant_linear
from workers.layers.linear import copy_shard
from workers.layers.parallel import TensorParallelGroup

PAD_MULTIPLE = 64


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    if tp_size == 1:
        return vocab_size
    multiple = PAD_MULTIPLE * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids it owns, zeros the rest; an all-reduce completes every row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_local_rows = padded_vocab_size(vocab_size, tp.size) // tp.size
        self.vocab_start = tp.rank * self.num_local_rows
        self.weight = nn.Parameter(
            torch.empty(self.num_local_rows, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        # the whole checkpoint tensor is checked: a rank of padding alone copies none of it
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                             f"{expected}")
        num_real_rows = max(0, min(self.num_local_rows, self.vocab_size - self.vocab_start))
        # a slice, not narrow: narrow refuses a start past the vocabulary even for 0 rows
        real = loaded[self.vocab_start : self.vocab_start + num_real_rows]
        copy_shard(param.data[:num_real_rows], real)
        param.data[num_real_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        owned = (local_ids >= 0) & (local_ids < self.num_local_rows)
        rows = F.embedding(local_ids.masked_fill(~owned, 0), self.weight)  # (T, hidden)
        rows = rows.masked_fill(~owned.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Each rank scores its vocabulary shard; the shards are gathered on every rank.

    With tied embeddings the model assigns the embedding's Parameter to ``weight``: both use
    the same padding and sharding, so the shared tensor is right for both.
    """

    batch_invariant = False  # workers/layers/batch_invariant.py

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        product = invariant_linear if self.batch_invariant else F.linear
        local_logits = product(hidden, self.weight)  # (N, V_local)
        logits = self.tp.all_gather(local_logits, dim=-1)  # (N, V_padded)
        return logits[..., : self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
