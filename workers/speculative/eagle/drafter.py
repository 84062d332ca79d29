"""Drafting with an EAGLE head in the target's worker (rank 0), in the draft model's place:
the same calls (``draft``, ``release``, ``allocate``), the same rule that a step without
drafts never touches it.

Every forward of the target stores its features (EAGLE-1: the final normed hidden state;
EAGLE-3: the residual stream entering the head's three layers) into a paged feature cache
indexed, like the KV cache, by the target's slots (``store``): a sequence's features stay
wherever its blocks do, a prefix hit finds them with the blocks it reuses (they are a function
of the prefix), and a sequence that drafts after a pause finds every feature it missed.

A row drafts at the start of the step that verifies: it has tokens t_0..t_{L-1}, of which the
target computed (and stored features for) positions 0..L-2. The head catches up in one forward
over the positions it has not seen with true features, position p taking (t_{p+1}, f_p), up
to L - 2, whose output gives the first draft (the token at L); then each further draft is one
step at the next position, fed the draft before it and the head's own output as the feature.
Those chained positions hold K/V made from predicted features: the next drafting computes
them again from the target's (their slots are simply overwritten), so only positions up to
L - 2 count as known.

Both run as one-token rows through ``HeadStep`` (the head over a static feature buffer, so a
CUDA graph of the target's decode kind holds it): the catch-up as one row per missed position
(a row sees the rows before it of its sequence: each layer stores the step's K/V before it
attends) whenever a graph holds them all, or without graphs when each row is a few tokens
behind; a longer catch-up (a new prompt) runs as one eager prefill-like forward.
"""

from pathlib import Path

import numpy as np
import torch

from workers.input_batch import (
    DecodeRows,
    block_table_array,
    build_input_batch,
    forward_decode_rows,
    packed_to_device,
    slots_of,
    span_rows,
    to_device,
)
from workers.kv_cache import KVCaches, allocate_kv_caches, kv_bytes_per_block
from workers.speculative.device_drafts import DeviceDrafts, drafts_table
from workers.speculative.draft_model import RowState
from workers.speculative.eagle.head import EagleHead
from workers.speculative.eagle.head_config import read_head_config
from workers.speculative.eagle.head_weights import head_tensors
from workers.step_input import ScheduledRequest


class HeadStep(torch.nn.Module):
    """The head as a decode model: ``(input_ids, positions, kv_caches, meta)`` in, as
    DecodeGraphs calls a model, the features read from ``self.features`` (written before each
    call), and out one (rows, 2 H) tensor: the rows for the lm_head, then the output stream."""

    def __init__(self, head: EagleHead, max_rows: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.head = head
        self.features = torch.zeros(max_rows, width, dtype=dtype, device=device)

    def forward(self, input_ids, positions, kv_caches, meta):  # type: ignore[no-untyped-def]
        rows, stream = self.head(input_ids, positions, self.features[:input_ids.shape[0]],
                                 kv_caches, meta)
        return torch.cat([rows, stream], dim=-1)


def rows_at(tensor: torch.Tensor, rows: np.ndarray, index: torch.Tensor) -> torch.Tensor:
    """``tensor``'s ``rows`` (increasing; ``index``: the same on the device): a view when they
    are consecutive (one sequence, or one row each: every catch-up of a batch of 1), which
    launches nothing, else a gather."""
    first = int(rows[0])
    if int(rows[-1]) - first == len(rows) - 1:
        return tensor[first:first + len(rows)]
    return tensor[index]


class ShiftedRow:
    """A row's tokens one place on: position p's input is token p + 1 (EAGLE's pairing of a
    position's feature with the token after it)."""

    def __init__(self, state: RowState) -> None:
        self.token_ids = state.token_ids[1:]
        self.block_ids = state.block_ids


def whole_target_tensors(target, target_config,  # type: ignore[no-untyped-def]
                         folder: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and lm_head over its whole vocabulary: the shard's own (less
    the padding) on one rank, read from the checkpoint under tensor parallelism (a shard
    holds a slice of each; the head runs whole, with no collective in its chain)."""
    vocab = target_config.vocab_size
    if folder is None:
        return target.model.embed_tokens.weight[:vocab], target.lm_head.weight[:vocab]
    from workers.loader import weight_files

    wanted = {"model.embed_tokens.weight", "lm_head.weight"}
    found: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(folder)):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            for name in wanted & set(handle.keys()):
                found[name] = handle.get_tensor(name)
    embedding = found["model.embed_tokens.weight"]
    return embedding, found.get("lm_head.weight", embedding)  # tied: the same tensor


class EagleDrafter:
    def __init__(self, folder: str, method: str, target, target_config,  # type: ignore[no-untyped-def]
                 dtype: torch.dtype, device: torch.device, backend, num_drafts: int,
                 block_size: int, target_folder: str | None = None) -> None:
        """``target_folder``: where the target's whole embedding (and lm_head) are read
        from when its shard holds a part of them (tensor parallel); None: the shard's own."""
        self.config = read_head_config(Path(folder), target_config, method)
        with torch.device(device):
            self.head = EagleHead(self.config, backend)
        self.head.to(dtype)
        self.head.load_weights(head_tensors(Path(folder)))
        embedding, lm_head = whole_target_tensors(target, target_config, target_folder)
        self.head.share_target(embedding.to(device, dtype),
                               None if self.config.method == "eagle3" else
                               lm_head.to(device, dtype))
        self.head.eval()
        if self.config.method == "eagle3":  # the target keeps the streams the head reads
            target.model.aux_layers = self.config.aux_layer_ids
        self.target = target
        self.dtype, self.device = dtype, device
        self.num_drafts, self.block_size = num_drafts, block_size
        self.kv_caches: KVCaches = []
        self.features = torch.empty(0, self.config.feature_size, dtype=dtype, device=device)
        self.computed: dict[str, int] = {}  # per request: leading positions of known K/V
        self.caught_up = 0
        self.max_model_len = 0
        self.graphs = None  # DecodeGraphs of HeadStep, when the target has graphs too
        # a chain step's features are the head's own output (H wide); a catch-up's the
        # target's (feature_size wide): one buffer for each, each a HeadStep's
        self.chain_step: HeadStep | None = None
        self.catch_up_step: HeadStep | None = None

    def bytes_per_block(self) -> int:
        features = self.block_size * self.config.feature_size * self.dtype.itemsize
        return kv_bytes_per_block(self.config.hf_config(), 1, self.block_size,
                                  self.dtype) + features

    def allocate(self, num_blocks: int) -> None:
        self.graphs = None  # graphs hold the old cache's addresses
        self.kv_caches = allocate_kv_caches(self.config.hf_config(), 1, num_blocks,
                                            self.block_size, self.dtype, self.device)
        self.features = torch.zeros(num_blocks * self.block_size, self.config.feature_size,
                                    dtype=self.dtype, device=self.device)
        self.computed.clear()

    def block_features(self) -> torch.Tensor:
        """The feature cache by block (blocks, block size, features): a view the KV tiers
        copy with the target's K/V, so a block loaded back brings its features."""
        return self.features.view(-1, self.block_size, self.config.feature_size)

    def build_rotary_table(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.head.build_rotary_table(max_model_len)

    def _steps(self, max_rows: int) -> tuple[HeadStep, HeadStep]:
        """The two HeadSteps, with room for ``max_rows`` rows (grown eagerly only: graphs
        read the buffers they were captured with, and never get more rows than those)."""
        if self.chain_step is None or self.chain_step.features.shape[0] < max_rows:
            if self.graphs is not None:
                raise RuntimeError(f"{max_rows} head rows, more than its graphs were "
                                   f"captured for ({self.chain_step.features.shape[0]})")
            size = self.config.hidden_size
            self.chain_step = HeadStep(self.head, max_rows, size, self.dtype, self.device)
            self.catch_up_step = HeadStep(self.head, max_rows, self.config.feature_size,
                                          self.dtype, self.device)
        assert self.catch_up_step is not None
        return self.chain_step, self.catch_up_step

    def capture_graphs(self, max_num_seqs: int) -> None:
        """CUDA graphs of the head's one-token steps (its chain; a catch-up whose rows fit),
        as the target has. One device, no collectives; eager if capture fails."""
        from workers.cuda_graphs import DecodeGraphs, capture_sizes

        # room for the largest bucket's rows (it may be above max_num_seqs: 5 rows go in 8)
        chain, catch_up = self._steps(capture_sizes(max_num_seqs)[-1])
        captured = []
        for step in (chain, catch_up):
            graphs = DecodeGraphs(step, self.kv_caches, max_num_seqs, self.max_model_len,
                                  self.block_size, self.device)
            graphs.warm_up()
            captured.append(graphs if graphs.capture() is None else None)
        self.graphs = captured if all(g is not None for g in captured) else None

    def _run_step(self, step: HeadStep, which: int, rows: DecodeRows,
                  features: torch.Tensor | None,
                  input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows for the lm_head, output stream) of one-token rows with these features (None:
        already in ``step.features``). Under graphs both are views of the graph's output,
        good until its next replay."""
        if features is not None:
            step.features[:features.shape[0]] = features
        graphs = self.graphs[which] if self.graphs is not None else None
        out = forward_decode_rows(step, self.kv_caches, graphs, rows, self.device, input_ids)
        size = self.config.hidden_size
        return out[:, :size], out[:, size:]

    def store(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """A target forward's features at its (T,) slots; ``hidden`` its final (T, H) rows."""
        features = hidden if self.config.method == "eagle" else self.target.model.aux_features
        self.features[slots] = features.to(self.dtype)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.computed.pop(request_id, None)

    def take_caught_up(self) -> int:
        caught_up, self.caught_up = self.caught_up, 0
        return caught_up

    def draft(self, request_ids: list[str], states: list[RowState],
              counts: list[int]) -> list[list[int]]:
        return self.draft_table(request_ids, states, counts).to_host()

    @torch.inference_mode()
    def draft_table(self, request_ids: list[str], states: list[RowState],
                    counts: list[int]) -> DeviceDrafts:
        """``counts[r]`` greedy drafts after each row's tokens (the target computes the newest
        in this step; the scheduler allocated the slots of the step's 1 + k tokens), left on
        the device."""
        stream, first = self._catch_up(request_ids, states)
        order = sorted(range(len(states)), key=lambda r: -counts[r])  # the longest first
        chain, _ = self._steps(len(states))
        proposed = [first]
        if order != list(range(len(order))):  # rows drafting alike stay where they are
            # pinned: a pageable copy would wait for the catch-up, and the chain's steps would
            # only be queued after it
            index = to_device(np.array(order, dtype=np.int64), self.device)
            proposed, stream = [first[index]], stream[index]
        table = block_table_array([states[r].block_ids for r in order])
        positions = np.array([len(states[r].token_ids) - 2 for r in order], dtype=np.int64)
        for step in range(1, max(counts)):
            live = sum(counts[r] > step for r in order)  # a prefix of ``order``
            at = positions[:live] + step
            step_rows = DecodeRows([request_ids[r] for r in order[:live]],
                                   np.zeros(live, dtype=np.int64), at,
                                   slots_of(table[:live], np.arange(live), at, self.block_size),
                                   table[:live])
            out, stream = self._run_step(chain, 0, step_rows, stream[:live],
                                         proposed[-1][:live])
            proposed.append(self.head.draft_tokens(out))
        return drafts_table(proposed, order, counts)

    def _catch_up(self, request_ids: list[str], states: list[RowState]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over each row's positions it has not seen (from the target's
        features) up to L - 2: (the head's output stream at L - 2 (rows, H), the first
        drafts (rows,))."""
        starts, lasts = [], []
        for request_id, state in zip(request_ids, states, strict=True):
            last = len(state.token_ids) - 2  # the newest position the target computed
            starts.append(min(self.computed.get(request_id, 0), last))
            lasts.append(last)
            self.computed[request_id] = last + 1
        missing = [last + 1 - start for start, last in zip(starts, lasts, strict=True)]
        self.caught_up += sum(missing)
        if self._as_rows(missing):
            # missed position p takes token p + 1
            rows, newest = span_rows(
                request_ids, [state.token_ids[start + 1:last + 2] for state, start, last in
                              zip(states, starts, lasts, strict=True)],
                starts, [state.block_ids for state in states], self.block_size)
            _, catch_up = self._steps(len(rows.request_ids))
            slots, index = packed_to_device([rows.slots, newest], np.int64, self.device)
            # the features gathered straight into the step's buffer
            torch.index_select(self.features, 0, slots, out=catch_up.features[:len(slots)])
            out, stream = self._run_step(catch_up, 1, rows, None)
            return (rows_at(stream, newest, index),
                    self.head.draft_tokens(rows_at(out, newest, index)))
        items = [ScheduledRequest(request_id, start, count) for request_id, start, count in
                 zip(request_ids, starts, missing, strict=True)]
        shifted = {request_id: ShiftedRow(state)
                   for request_id, state in zip(request_ids, states, strict=True)}
        batch = build_input_batch(items, shifted, self.block_size,  # type: ignore[arg-type]
                                  self.device)
        features = self.features[batch.meta.slot_mapping]
        out, stream = self.head(batch.input_ids, batch.positions, features, self.kv_caches,
                                batch.meta)
        index = batch.sample_indices
        return stream[index], self.head.draft_tokens(out[index])

    def _as_rows(self, missing: list[int]) -> bool:
        """Whether the catch-up runs as one-token rows: whenever a graph holds them all, and
        without graphs when each row is a few tokens behind (its accepted drafts and the
        target's next token, a sequence that drafts every step)."""
        if self.graphs is not None:
            assert self.catch_up_step is not None
            room = min(self.graphs[1].sizes[-1], self.catch_up_step.features.shape[0])
            return sum(missing) <= room
        return max(missing) <= 1 + self.num_drafts
