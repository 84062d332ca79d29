"""What an attention backend needs to know about one flat batch of tokens.

A step runs the tokens of many sequences as one flat batch of T tokens. Sequence i owns the
query rows ``query_start_loc[i] : query_start_loc[i + 1]``; those are its *new* tokens, the last
``q_len_i`` of its ``seq_lens[i]`` tokens of context. Its earlier tokens are already in the paged
KV cache, in the blocks listed by ``block_tables[i]``::

    context of sequence i:  [ cached (seq_len - q_len) | new (q_len) ]
    position of new token j:  seq_len - q_len + j      (attends to keys at positions <= it)

Slot s of the cache is row ``s % block_size`` of block ``s // block_size``.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # (B + 1,) int32: cumulative query lengths
    seq_lens: torch.Tensor  # (B,) int32: context length after this step, cached + new
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # host copies, so the reference backend never syncs with the device to read lengths
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # a CUDA graph fixes the decode kernel's split count at capture (max_seq_len then varies)
    decode_num_splits: int | None = None
    # (B,) int32, pure decode of B > 1 rows: the rows longest context first, the order the
    # decode kernel takes them in (it only schedules; see workers/attention/triton_decode.py)
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """A decode batch's ``decode_order``: its rows by context length, longest first (ties in
    row order). Padding rows (length 0) come last."""
    return np.argsort(-seq_lens, kind="stable").astype(np.int32)


def whole_sequence(num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """One sequence's every token as one step's new tokens, in blocks 0, 1, 2, ... (slot s
    for position s): a calibration or teacher-forced pass over a fresh cache."""
    num_blocks = -(-num_tokens // block_size)
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens, max_seq_len=num_tokens,
        query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens],
    )  # fmt: skip
