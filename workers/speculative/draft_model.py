"""A draft model beside the target: a smaller model of the same vocabulary whose paged KV
cache is indexed by the target's own block ids.

It runs only in the steps where some row drafts, and only for those rows: at the start of
such a step it brings each row's K/V up to date in one forward over the tokens it has not
seen (its accepted drafts and the target's next token for a row that drafted last step; what
it missed for one back from a pause; the whole context for one new to it), as one-token rows
in a CUDA graph when one holds them (``_as_rows``), samples each row's first draft from its
last position, then makes the rest in one-token steps (graphed), greedily: a deterministic proposal,
which verification treats as a one-hot and so keeps sampled output exact at any temperature.
Steps without drafts never touch it, so they run as the plain engine's do (multi-step calls,
the lookahead step).

Which of its K/V stays valid is settled lazily, the next time a row drafts: draft step j
wrote position ``L - 2 + j`` (``L``: the row's tokens when it drafted) from draft ``j - 1``,
so with ``a`` drafts accepted the first ``L - 1 + min(k, a + 1)`` positions hold the right
K/V; the target's tokens since then say what ``a`` was. A position computed again writes the
same slot, so a rejected draft's K/V is simply overwritten.
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from workers.input_batch import (
    DecodeRows,
    InputBatch,
    block_table_array,
    build_input_batch,
    forward_decode_rows,
    slots_of,
    span_rows,
    to_device,
)
from workers.kv_cache import KVCaches, allocate_kv_caches, kv_bytes_per_block
from workers.layers.parallel import TensorParallelGroup
from workers.loader import load_model
from workers.sampler import greedy
from workers.speculative.device_drafts import DeviceDrafts, drafts_table
from workers.step_input import ScheduledRequest


class RowState(Protocol):
    """What the draft reads of a request: a worker's RequestState, or the draft actor's."""

    token_ids: list[int]
    block_ids: list[int]


@dataclass
class Drafted:
    """A row's last drafting: its token count then, and the drafts it made (row ``row`` of
    the step's table, left on the device: read when the next drafting settles them, after
    the verify's read)."""

    num_tokens: int
    table: DeviceDrafts
    row: int

    def valid_positions(self, token_ids: list[int]) -> int:
        """How many leading positions of the draft's cache hold the right K/V, now that the
        target's ``token_ids`` say which drafts were accepted."""
        start = self.num_tokens
        drafts = self.table.to_host()[self.row]
        accepted = 0
        for draft, token in zip(drafts, token_ids[start:], strict=False):
            if draft != token:
                break
            accepted += 1
        return start - 1 + min(len(drafts), accepted + 1)


class DraftModel:
    def __init__(self, folder: str, dtype: torch.dtype, device: torch.device, backend,  # type: ignore[no-untyped-def]
                 num_drafts: int, block_size: int) -> None:
        self.model, self.hf_config = load_model(folder, dtype, device,
                                                TensorParallelGroup.single(), backend)
        self.dtype, self.device = dtype, device
        self.num_drafts, self.block_size = num_drafts, block_size
        self.kv_caches: KVCaches = []
        self.max_model_len = 0
        self.graphs = None  # DecodeGraphs, when the target has graphs too
        # per request: positions whose K/V is known right, and its last drafting
        self.computed: dict[str, int] = {}
        self.drafted: dict[str, Drafted] = {}
        self.caught_up = 0  # tokens caught up on since take_caught_up

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.hf_config, 1, self.block_size, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        self.graphs = None  # graphs hold the old cache's addresses
        self.kv_caches = allocate_kv_caches(self.hf_config, 1, num_blocks, self.block_size,
                                            self.dtype, self.device)
        self.computed.clear()
        self.drafted.clear()

    def build_rotary_table(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.model.build_rotary_table(max_model_len)

    def capture_graphs(self, max_num_seqs: int) -> None:
        """CUDA graphs of the draft's one-token steps, as the target has (a draft step eagerly
        costs several graphed ones: its time is launches). One device, no collectives: the
        draft needs no agreement with other ranks, and runs eagerly if capture fails."""
        from workers.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs, self.max_model_len,
                              self.block_size, self.device)
        graphs.warm_up()
        self.graphs = graphs if graphs.capture() is None else None

    def release(self, request_ids: list[str]) -> None:
        """Requests the target dropped (finished, aborted, preempted): a preempted one comes
        back with blocks of its own, whose K/V the draft has never written."""
        for request_id in request_ids:
            self.computed.pop(request_id, None)
            self.drafted.pop(request_id, None)

    def draft(self, request_ids: list[str], states: list[RowState],
              counts: list[int]) -> list[list[int]]:
        return self.draft_table(request_ids, states, counts).to_host()

    def draft_table(self, request_ids: list[str], states: list[RowState],
                    counts: list[int]) -> DeviceDrafts:
        """``counts[r]`` drafts after each row's tokens (its state's, the newest of which the
        target computes in this step), left on the device. Each row's count fits its slots
        and the model's length: the scheduler allocated the step's 1 + k tokens."""
        tokens = self._catch_up(request_ids, states)
        order = sorted(range(len(states)), key=lambda r: -counts[r])  # the longest first
        rows = self._decode_rows([request_ids[r] for r in order], [states[r] for r in order])
        if order != list(range(len(order))):  # rows drafting alike stay where they are
            tokens = tokens[to_device(np.array(order, dtype=np.int64), self.device)]
        proposed = [tokens]
        for index in range(1, max(counts)):
            live = sum(counts[r] > index for r in order)  # a prefix of ``order``
            step = rows.first(live).advanced(index, self.block_size)
            hidden = forward_decode_rows(self.model, self.kv_caches, self.graphs, step,
                                         self.device, proposed[-1][:live])
            proposed.append(greedy(self.model.compute_logits(hidden)))
        table = drafts_table(proposed, order, counts)
        for row, (request_id, state) in enumerate(zip(request_ids, states, strict=True)):
            self.drafted[request_id] = Drafted(len(state.token_ids), table, row)
        return table

    def _catch_up(self, request_ids: list[str], states: list[RowState]) -> torch.Tensor:
        """The first draft of each row, from one forward over the tokens the draft has not
        seen up to and including the row's newest: (rows,) on the device."""
        starts = [self._known(request_id, state) for request_id, state in
                  zip(request_ids, states, strict=True)]
        missing = [len(state.token_ids) - start for start, state in
                   zip(starts, states, strict=True)]
        if self._as_rows(missing):
            # each row's unseen tokens at their positions
            rows, last = span_rows(request_ids, [state.token_ids[start:] for state, start in
                                                 zip(states, starts, strict=True)],
                                   starts, [state.block_ids for state in states],
                                   self.block_size)
            hidden = forward_decode_rows(self.model, self.kv_caches, self.graphs, rows,
                                         self.device)
            hidden = hidden[to_device(last, self.device)]
        else:
            items = [ScheduledRequest(request_id, start, count)
                     for request_id, start, count in zip(request_ids, starts, missing,
                                                         strict=True)]
            by_id = dict(zip(request_ids, states, strict=True))
            batch: InputBatch = build_input_batch(items, by_id,  # type: ignore[arg-type]
                                                  self.block_size, self.device)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            hidden = hidden[batch.sample_indices]
        for request_id, state in zip(request_ids, states, strict=True):
            self.computed[request_id] = len(state.token_ids)
        self.caught_up += sum(missing)
        return greedy(self.model.compute_logits(hidden))

    def take_caught_up(self) -> int:
        """Tokens caught up on since the last call (the step's, for its cost)."""
        caught_up, self.caught_up = self.caught_up, 0
        return caught_up

    def _as_rows(self, missing: list[int]) -> bool:
        """Whether the catch-up runs as one-token rows: whenever a CUDA graph holds them all
        (an eager forward of a draft costs several graphed steps: its time is launches, so
        a sequence back from a pause, or new to the draft, pays one graphed step), and
        without graphs when each row is a few tokens behind (its accepted drafts and the
        target's next token), where a prefill's kernels would gain nothing."""
        if self.graphs is not None:
            return sum(missing) <= self.graphs.sizes[-1]
        return max(missing) <= 1 + self.num_drafts

    def _known(self, request_id: str, state: RowState) -> int:
        """Leading positions of the row whose draft K/V is right (settling its last
        drafting against the tokens the target accepted since)."""
        drafted = self.drafted.pop(request_id, None)
        known = self.computed.get(request_id, 0)
        if drafted is not None:
            known = drafted.valid_positions(state.token_ids)
        return min(known, len(state.token_ids) - 1)

    def _decode_rows(self, request_ids: list[str], states: list[RowState]) -> DecodeRows:
        """The rows' newest tokens as one-token rows at their positions."""
        positions = np.array([len(state.token_ids) - 1 for state in states], dtype=np.int64)
        table = block_table_array([state.block_ids for state in states])
        return DecodeRows(list(request_ids),
                          np.array([state.token_ids[-1] for state in states], dtype=np.int64),
                          positions, slots_of(table, np.arange(len(states)), positions,
                                              self.block_size), table)
