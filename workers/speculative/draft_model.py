"""A draft model beside the target, in the target's worker: a smaller model of the same
vocabulary whose paged KV cache is indexed by the target's own block ids.

Every step it runs over the same tokens as the target (prefill chunks, decodes, verified
drafts alike, with the same attention metadata), so its cache holds what the target's does:
a rejected draft's K/V sits in a slot the next step writes again, a prefix hit's blocks were
filled by the step that computed them, and a preempted sequence is recomputed in both. After
the step it proposes k tokens for each row that sampled, greedily (a deterministic proposal:
verification treats it as a one-hot, which keeps sampled output exact at any temperature),
in k one-token steps into the slots the scheduler set aside after the row's tokens.
"""

import numpy as np
import torch

from workers.input_batch import (
    DecodeRows,
    InputBatch,
    block_table_array,
    forward_decode_rows,
    slots_of,
)
from workers.kv_cache import KVCaches, allocate_kv_caches, kv_bytes_per_block
from workers.layers.parallel import TensorParallelGroup
from workers.loader import load_model
from workers.request_state import RequestState
from workers.sampler import greedy


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

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.hf_config, 1, self.block_size, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        self.graphs = None  # graphs hold the old cache's addresses
        self.kv_caches = allocate_kv_caches(self.hf_config, 1, num_blocks, self.block_size,
                                            self.dtype, self.device)

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

    def follow(self, batch: InputBatch) -> None:
        """The step's tokens through the draft: its K/V, in the same slots as the target's."""
        self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)

    def follow_rows(self, rows: DecodeRows) -> None:
        """``follow`` for a step of decode rows (a decode or a verify step): graphed."""
        self._forward_rows(rows, None)

    def _forward_rows(self, rows: DecodeRows, tokens: torch.Tensor | None) -> torch.Tensor:
        return forward_decode_rows(self.model, self.kv_caches, self.graphs, rows, self.device,
                                   tokens)

    def propose(self, states: list[RequestState], emitted: list[list[int]]) -> list[list[int]]:
        """k drafts after each row's tokens (its state's, then ``emitted`` this step); none for
        a row too near the model's length for k more positions."""
        rows = [row for row, (state, tokens) in enumerate(zip(states, emitted, strict=True))
                if tokens and len(state.token_ids) + len(tokens) - 1 + self.num_drafts
                <= self.max_model_len]
        drafts: list[list[int]] = [[] for _ in states]
        if not rows:
            return drafts
        positions = np.array([len(states[r].token_ids) + len(emitted[r]) - 1 for r in rows],
                             dtype=np.int64)
        table = block_table_array([states[r].block_ids for r in rows])
        first = DecodeRows([str(r) for r in rows],
                           np.array([emitted[r][-1] for r in rows], dtype=np.int64), positions,
                           slots_of(table, np.arange(len(rows)), positions, self.block_size),
                           table)
        tokens: torch.Tensor | None = None
        proposed = []
        for index in range(self.num_drafts):
            step = first.advanced(index, self.block_size) if index else first
            hidden = self._forward_rows(step, tokens)
            tokens = greedy(self.model.compute_logits(hidden))
            proposed.append(tokens)
        for row, values in zip(rows, torch.stack(proposed, dim=1).tolist(), strict=True):
            drafts[row] = values
        return drafts
