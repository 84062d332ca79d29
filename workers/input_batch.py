"""Turns the scheduled sequences of one step into the flat tensors the model runs on.

Inputs are built as numpy arrays on the host, packed into two buffers (int64 and int32) and
sent with one copy each: from pinned memory with ``non_blocking`` on a GPU, so building a step
never waits for the device.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.attention.metadata import AttentionMetadata, longest_first
from workers.request_state import RequestState
from workers.step_input import ScheduledRequest


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_request_ids: list[str]  # sequences that reach their last token and sample
    sample_indices: torch.Tensor  # (S,) rows of the flat batch sampled at, in their order:
    # one a sequence, its last token's; 1 + k for a sequence verifying k drafts
    draft_token_ids: list[list[int]] | None = None  # per sampling sequence, when any has some


@dataclass
class DecodeRows:
    """Host arrays of a pure-decode step: one new token per sequence, and every one samples."""

    request_ids: list[str]
    input_ids: np.ndarray  # (B,) int64
    positions: np.ndarray  # (B,) int64
    slots: np.ndarray  # (B,) int64
    block_tables: np.ndarray  # (B, max_blocks) int32, padded with 0

    @property
    def seq_lens(self) -> np.ndarray:  # (B,) context after this step
        return self.positions + 1

    def first(self, count: int) -> "DecodeRows":
        """The first ``count`` rows."""
        return DecodeRows(self.request_ids[:count], self.input_ids[:count],
                          self.positions[:count], self.slots[:count], self.block_tables[:count])

    def advanced(self, num_steps: int, block_size: int) -> "DecodeRows":
        """The rows ``num_steps`` decode steps later (their input tokens unknown here: the
        caller feeds them from the device). The block table already holds those slots."""
        positions = self.positions + num_steps
        slots = slots_of(self.block_tables, np.arange(len(positions)), positions, block_size)
        return DecodeRows(self.request_ids, self.input_ids, positions, slots, self.block_tables)


def block_table_array(block_ids: Sequence[list[int]]) -> np.ndarray:
    """(B, max_blocks) int32, each row padded with 0."""
    width = max(len(ids) for ids in block_ids)
    table = np.zeros((len(block_ids), width), dtype=np.int32)
    for row, ids in enumerate(block_ids):
        table[row, : len(ids)] = ids
    return table


def slots_of(table: np.ndarray, rows: np.ndarray, positions: np.ndarray,
             block_size: int) -> np.ndarray:
    """Cache slot of each token: row ``pos % block_size`` of block ``table[row, pos // bs]``."""
    blocks = table[rows, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


def build_decode_rows(
    scheduled: Sequence[ScheduledRequest], states: dict[str, RequestState], block_size: int
) -> DecodeRows | None:
    """The step as DecodeRows, or None when it is not pure decode (a prefill chunk, or a
    sequence that does not sample)."""
    request_ids, tokens, positions, block_ids = [], [], [], []
    for item in scheduled:
        state = states[item.request_id]
        if item.num_new_tokens != 1 or item.num_computed_tokens + 1 != len(state.token_ids):
            return None
        request_ids.append(item.request_id)
        tokens.append(state.token_ids[-1])
        positions.append(item.num_computed_tokens)
        block_ids.append(state.block_ids)
    if not request_ids:
        return None
    table = block_table_array(block_ids)
    pos = np.array(positions, dtype=np.int64)
    slots = slots_of(table, np.arange(len(pos)), pos, block_size)
    return DecodeRows(request_ids, np.array(tokens, dtype=np.int64), pos, slots, table)


@dataclass
class VerifyRows:
    """A verify step as decode rows: every sequence decodes its last token, and one row more
    for each of its drafts, at the positions after it. Row j of a sequence sees the context up
    to its own token (the rows before it stored theirs in the same layer first), which is the
    causal verify forward; as decode rows it runs the plain decode step's kernels and CUDA
    graphs, so a draft is judged by the same arithmetic that would have produced the token."""

    rows: DecodeRows  # one a token: each sequence's last token, then its drafts
    request_ids: list[str]  # one a sequence, in the rows' order
    drafts: list[list[int]]  # per sequence, [] for one without drafts


def build_verify_rows(
    scheduled: Sequence[ScheduledRequest], states: dict[str, RequestState], block_size: int
) -> VerifyRows | None:
    """The step as VerifyRows, or None when it has no drafts or is not pure decode."""
    if not any(item.draft_token_ids for item in scheduled):
        return None
    request_ids, drafts, tokens, positions, block_ids = [], [], [], [], []
    for item in scheduled:
        state, draft = states[item.request_id], item.draft_token_ids
        if (item.num_new_tokens != 1 + len(draft)
                or item.num_computed_tokens + 1 != len(state.token_ids)):
            return None
        request_ids.append(item.request_id)
        drafts.append(draft)
        tokens += [state.token_ids[-1], *draft]
        positions += range(item.num_computed_tokens, item.num_computed_tokens + 1 + len(draft))
        block_ids += [state.block_ids] * (1 + len(draft))
    table = block_table_array(block_ids)
    pos = np.array(positions, dtype=np.int64)
    slots = slots_of(table, np.arange(len(pos)), pos, block_size)
    row_ids = [r for r, d in zip(request_ids, drafts, strict=True) for _ in range(1 + len(d))]
    rows = DecodeRows(row_ids, np.array(tokens, dtype=np.int64), pos, slots, table)
    return VerifyRows(rows, request_ids, drafts)


def span_rows(request_ids: Sequence[str], spans: Sequence[list[int]], starts: Sequence[int],
              block_ids: Sequence[list[int]], block_size: int) -> tuple[DecodeRows, np.ndarray]:
    """Each sequence's ``spans[r]`` tokens as one-token rows at positions ``starts[r]``,
    ``starts[r] + 1``, ... (a row sees the rows before it of its sequence: each layer stores
    the step's K/V before it attends), and the index of each sequence's last row."""
    ids, tokens, positions, tables = [], [], [], []
    for request_id, span, start, blocks in zip(request_ids, spans, starts, block_ids,
                                               strict=True):
        ids += [request_id] * len(span)
        tokens += span
        positions += range(start, start + len(span))
        tables += [blocks] * len(span)
    table = block_table_array(tables)
    pos = np.array(positions, dtype=np.int64)
    rows = DecodeRows(ids, np.array(tokens, dtype=np.int64), pos,
                      slots_of(table, np.arange(len(pos)), pos, block_size), table)
    return rows, (np.cumsum([len(span) for span in spans]) - 1).astype(np.int64)


def decode_batch(rows: DecodeRows, device: torch.device,
                 input_ids: torch.Tensor | None = None) -> InputBatch:
    """An eager InputBatch of a pure-decode step; ``input_ids`` (B,) on the device, when given,
    replace the rows' host tokens (the tokens the step before sampled, never read back)."""
    num_seqs = len(rows.request_ids)
    table = rows.block_tables
    # the rows' host tokens go only when the device does not already hold the step's tokens
    host_ids = [rows.input_ids] if input_ids is None else []
    *ids, pos, slots = packed_to_device([*host_ids, rows.positions, rows.slots], np.int64, device)
    # one row has nothing to order: its kernel skips the extra load
    order = [longest_first(rows.seq_lens)] if num_seqs > 1 else []
    qsl, lens, flat_table, *order_on_device = packed_to_device(
        [np.arange(num_seqs + 1), rows.seq_lens, table.ravel(), *order], np.int32, device)
    seq_lens = rows.seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=qsl, seq_lens=lens,
        block_tables=flat_table.view(table.shape), max_query_len=1, max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * num_seqs, seq_lens_cpu=seq_lens,
        decode_order=order_on_device[0] if order_on_device else None,
    )
    sample_indices = torch.arange(num_seqs, device=device)
    return InputBatch(ids[0] if input_ids is None else input_ids, pos, meta,
                      list(rows.request_ids), sample_indices)


def forward_decode_rows(model, kv_caches, graphs, rows: DecodeRows,  # type: ignore[no-untyped-def]
                        device: torch.device,
                        input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden states of a step of decode rows: the CUDA graph of its bucket when ``graphs``
    (workers/cuda_graphs.py DecodeGraphs, or None) has one that fits, else the model eagerly.
    ``input_ids`` (n,) on the device, when given, replace the rows' host tokens."""
    if graphs is not None:
        hidden = graphs.run(rows, input_ids)
        if hidden is not None:
            return hidden
    batch = decode_batch(rows, device, input_ids)
    return model(batch.input_ids, batch.positions, kv_caches, batch.meta)


ALIGN_BYTES = 16


def packed_to_device(segments: Sequence[np.ndarray], dtype: type,
                     device: torch.device) -> list[torch.Tensor]:
    """The segments in one buffer, sent with one copy; the device views of each, in order.

    Every segment starts 16-byte aligned. Triton compiles a kernel once per alignment class
    of its pointers, so a segment whose alignment followed the step's sizes would make some
    steps compile a new kernel in the middle of serving (about half a second each)."""
    per = ALIGN_BYTES // np.dtype(dtype).itemsize
    sizes = [len(segment) for segment in segments]
    starts = np.cumsum([0] + [-(-n // per) * per for n in sizes])
    flat = np.zeros(int(starts[-1]), dtype=dtype)
    for start, segment in zip(starts[:-1], segments, strict=True):
        flat[start : start + len(segment)] = segment
    tensor = to_device(flat, device)
    return [tensor[start : start + n] for start, n in zip(starts[:-1], sizes, strict=True)]


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host-to-device copy; through pinned memory on a GPU, so it does not block."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def build_input_batch(
    scheduled: Sequence[ScheduledRequest],
    states: dict[str, RequestState],
    block_size: int,
    device: torch.device,
) -> InputBatch:
    query_lens = np.array([item.num_new_tokens for item in scheduled], dtype=np.int64)
    starts = np.array([item.num_computed_tokens for item in scheduled], dtype=np.int64)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    input_ids: list[int] = []
    sample_ids: list[str] = []
    sample_rows: list[int] = []
    drafts: list[list[int]] = []
    for i, item in enumerate(scheduled):
        token_ids = states[item.request_id].token_ids
        draft = item.draft_token_ids
        known_end = int(seq_lens[i]) - len(draft)  # the drafts follow the known tokens
        input_ids += token_ids[starts[i] : known_end]
        input_ids += draft
        if known_end == len(token_ids):  # caught up: the last token's logits are sampled
            sample_ids.append(item.request_id)
            last = int(query_start_loc[i + 1]) - 1
            sample_rows += range(last - len(draft), last + 1)  # and each draft's
            drafts.append(draft)
    rows = np.repeat(np.arange(len(scheduled)), query_lens)  # (T,) sequence of each token
    positions = np.arange(num_tokens) - query_start_loc[rows] + starts[rows]
    table = block_table_array([states[item.request_id].block_ids for item in scheduled])
    slots = slots_of(table, rows, positions, block_size)

    # (T ids | T positions | T slots | S sample rows) and (B+1 starts | B seq lens | B x W table)
    ids, pos, slot, sample = packed_to_device(
        [np.array(input_ids), positions, slots, np.array(sample_rows)], np.int64, device)
    qsl, lens, flat_table = packed_to_device(
        [query_start_loc, seq_lens, table.ravel()], np.int32, device)
    meta = AttentionMetadata(
        slot_mapping=slot,
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=flat_table.view(table.shape),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=query_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return InputBatch(ids, pos, meta, sample_ids, sample,
                      drafts if any(drafts) else None)
