"""The drafts a verify step asks the worker's own draft (a draft model or an EAGLE head) for:
made on rank 0 where the scheduler put ``num_model_drafts``, then either left on the device
(one rank, no grammar or logit_bias on those rows: workers/speculative/device_drafts.py; the
rows carry placeholders) or read and broadcast to every rank as token lists."""

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from workers.layers.parallel import TensorParallelGroup
from workers.request_state import RequestState
from workers.speculative.device_drafts import DeviceDrafts
from workers.step_input import ScheduledRequest


class StepDrafts:
    def __init__(self, draft, tp: TensorParallelGroup, device: torch.device) -> None:  # type: ignore[no-untyped-def]
        self.draft = draft  # DraftModel or EagleDrafter on rank 0; None on the other ranks
        self.tp, self.device = tp, device

    def fill(self, scheduled: list[ScheduledRequest], states: dict[str, RequestState],
             constrained: Callable[[list[RequestState]], bool],
             ) -> tuple[list[ScheduledRequest], DeviceDrafts | None]:
        """The step with drafts in the rows that asked for some, and the table when they
        stayed on the device (``constrained``: whether rows need their drafts on the host)."""
        wanted = [index for index, item in enumerate(scheduled) if item.num_model_drafts]
        if not wanted:
            return scheduled, None
        ids = [scheduled[index].request_id for index in wanted]
        counts = [scheduled[index].num_model_drafts for index in wanted]
        rows = [states[request_id] for request_id in ids] if self.draft is not None else []
        if self.draft is not None and self.tp.size == 1 and not constrained(rows):
            table = self.draft.draft_table(ids, rows, counts)
            # the drafts given with the step win (the benchmark's)
            table = table.given([scheduled[index].draft_token_ids for index in wanted])
            return with_drafts(scheduled, wanted, table.placeholders()), table
        drafts = None
        if self.draft is not None:
            drafts = self.draft.draft(ids, rows, counts)
        elif self.tp.rank == 0:
            raise ValueError("a step asks for a draft model's drafts, but this worker has none")
        drafts = self._from_driver(drafts, counts)
        # drafts it was sent win: the benchmark's, which prices the draft's work alone
        given = [scheduled[index].draft_token_ids or row for index, row in zip(
            wanted, drafts, strict=True)]
        return with_drafts(scheduled, wanted, given), None

    def _from_driver(self, drafts: list[list[int]] | None,
                     counts: list[int]) -> list[list[int]]:
        """Rank 0's drafts on every rank (one broadcast of a padded table under tensor
        parallelism)."""
        if self.tp.size == 1:
            assert drafts is not None
            return drafts
        table = torch.zeros((len(counts), max(counts)), dtype=torch.int64, device=self.device)
        if drafts is not None:
            for row, values in enumerate(drafts):
                table[row, : len(values)] = torch.tensor(values, dtype=torch.int64)
        rows = self.tp.broadcast(table, src=0).tolist()
        return [row[:count] for row, count in zip(rows, counts, strict=True)]


def with_drafts(scheduled: list[ScheduledRequest], wanted: Sequence[int],
                drafts: Sequence[list[int]]) -> list[ScheduledRequest]:
    """Rows ``wanted`` with ``drafts`` to verify (no more to make)."""
    scheduled = list(scheduled)
    for index, row in zip(wanted, drafts, strict=True):
        scheduled[index] = replace(scheduled[index], num_model_drafts=0, draft_token_ids=row)
    return scheduled


def with_host_drafts(scheduled: list[ScheduledRequest],
                     on_device: DeviceDrafts) -> list[ScheduledRequest]:
    """The placeholders replaced by the drafts, read from the device (a step that is not all
    decodes takes its drafts as tokens)."""
    drafts = iter(on_device.to_host())
    return [replace(item, draft_token_ids=next(drafts)) if item.draft_token_ids else item
            for item in scheduled]
