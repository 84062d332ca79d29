"""A step's model drafts left on the device: the draft (a draft model or an EAGLE head) writes
them into a table, the verify step's input and its rejection sampler read them there, so a
speculative step reads to the host once, its kept tokens, and the target's forward is queued
right behind the draft's steps with no wait for the host between them.

The scheduler's step carries placeholders of the right lengths in their place
(``draft_token_ids`` of zeros): the rows' layout is known on the host, their tokens only on
the device.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.input_batch import packed_to_device


@dataclass
class DeviceDrafts:
    table: torch.Tensor  # (rows, most drafts) int64: row r's first counts[r] are its drafts
    counts: list[int]  # in the order of the step's rows with drafts
    _host: list[list[int]] | None = None

    def placeholders(self) -> list[list[int]]:
        return [[0] * count for count in self.counts]

    def to_host(self) -> list[list[int]]:
        """The drafts as lists: a read, which waits for the draft (read once, then kept)."""
        if self._host is None:
            self._host = [row[:count] for row, count in
                          zip(self.table.tolist(), self.counts, strict=True)]
        return self._host

    def given(self, rows: Sequence[list[int] | None]) -> "DeviceDrafts":
        """The table with the rows whose drafts came with the step (the benchmark's oracle,
        which prices the draft's work alone) taking those: a copy, this one (what the draft
        itself fed on) unchanged."""
        at = [(r, j, token) for r, row in enumerate(rows) if row for j, token in enumerate(row)]
        if not at:
            return self
        index, values = packed_to_device([np.array([r * self.table.shape[1] + j
                                                    for r, j, _ in at]),
                                          np.array([token for _, _, token in at])],
                                         np.int64, self.table.device)
        table = self.table.clone()
        table.view(-1).index_copy_(0, index, values)
        return DeviceDrafts(table, self.counts)

    def verify_input(self, tokens: np.ndarray, starts: Sequence[int]) -> torch.Tensor:
        """A verify step's input ids on the device: ``tokens`` (its rows' host tokens, the
        drafts' placeholders among them) with row r's drafts after its token at ``starts[r]``."""
        width = self.table.shape[1]
        if all(count == width for count in self.counts) and len(tokens) == len(
                self.counts) * (width + 1):  # every row k drafts, none without: one copy
            (input_ids,) = packed_to_device([tokens], np.int64, self.table.device)
            input_ids.view(-1, width + 1)[:, 1:] = self.table
            return input_ids
        rows = np.repeat(np.arange(len(self.counts)), self.counts)
        columns = np.concatenate([np.arange(count) for count in self.counts])
        at = np.repeat(np.asarray(starts), self.counts) + 1 + columns
        input_ids, source, target = packed_to_device(
            [tokens, rows * width + columns, at], np.int64, self.table.device)
        input_ids[target] = self.table.view(-1)[source]
        return input_ids


def drafts_table(proposed: list[torch.Tensor], order: Sequence[int],
                 counts: Sequence[int]) -> DeviceDrafts:
    """The table of a chain that drafted the rows in ``order`` (the most drafts first), step j
    for the rows still drafting (``proposed[j]``: a prefix of ``order``)."""
    rows, width = len(order), len(proposed)
    device = proposed[0].device
    if all(values.shape[0] == rows for values in proposed):  # every row drafted every step
        by_rank = torch.stack(proposed, dim=1)  # one kernel, where a row a step took one each
    else:
        by_rank = torch.zeros(rows, width, dtype=torch.int64, device=device)
        for step, values in enumerate(proposed):
            by_rank[: values.shape[0], step] = values
    if list(order) == list(range(rows)):  # in the step's order already: nothing to gather
        return DeviceDrafts(by_rank, list(counts))
    rank_of = np.empty(rows, dtype=np.int64)
    rank_of[np.asarray(order)] = np.arange(rows)
    (index,) = packed_to_device([rank_of], np.int64, device)
    return DeviceDrafts(by_rank[index], list(counts))
