"""A draft model in a process of its own (cluster/ray/draft_actor.py) rather than inside the
target's worker: it keeps the tokens and block ids of the requests it drafts for, sent to it
as deltas only when they draft (``DraftRow``), and drafts as the in-worker draft does
(workers/speculative/draft_model.py), into a cache indexed by the target's block ids.
Steps in which nothing drafts never reach it.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workers.speculative.draft_model import DraftModel


@dataclass
class DraftRow:
    """One row that drafts this step: what its tokens and blocks gained since it last drafted
    (all of them when ``fresh``: new to the draft, or back after a preemption), and how many
    drafts it wants."""

    request_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_drafts: int
    fresh: bool = False


@dataclass
class DraftState:
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


class DraftFollower:
    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft
        self.states: dict[str, DraftState] = {}

    @torch.inference_mode()
    def draft_rows(self, rows: Sequence[DraftRow], released: Sequence[str]) -> list[list[int]]:
        """Drops the ``released`` requests, brings the rows' states up to date, and drafts."""
        self.draft.release(list(released))
        for request_id in released:
            self.states.pop(request_id, None)
        for row in rows:
            if row.fresh:
                self.draft.release([row.request_id])
                self.states[row.request_id] = DraftState()
            state = self.states[row.request_id]
            state.token_ids += row.new_token_ids
            state.block_ids += row.new_block_ids
        if not rows:
            return []
        ids = [row.request_id for row in rows]
        return self.draft.draft(ids, [self.states[i] for i in ids],
                                [row.num_drafts for row in rows])
