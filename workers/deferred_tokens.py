"""Tokens a step sampled that the host has not read yet (async scheduling).

With ``StepInput.defer_read`` a worker samples a step and keeps its tokens on the device: the
call returns the step before's tokens instead (read while this step runs), and the engine
schedules the next step before it knows these. Each sampled row gets a placeholder in its
``RequestState``; the next step's input at that position comes from the device
(``DeferredTokens.fill``), and a later step message writes the real token over it
(``RequestState.apply``). Every rank holds the tokens (a broadcast from rank 0 under tensor
parallelism), so every rank fills the same inputs.
"""

from dataclasses import dataclass

import numpy as np
import torch

from workers.input_batch import DecodeRows, to_device
from workers.request_state import RequestState
from workers.step_input import ScheduledRequest, StepInput, StepOutput


@dataclass
class DeferredTokens:
    request_ids: list[str]
    tokens: torch.Tensor  # (B,) on the device, in request_ids' order

    def fill(self, input_ids: torch.Tensor, wanted: list[tuple[int, str]]) -> None:
        """Writes into ``input_ids`` (on the device), at each (index, request id), the token
        this step sampled for that request."""
        if not wanted:
            return
        rows = {request_id: row for row, request_id in enumerate(self.request_ids)}
        missing = [request_id for _, request_id in wanted if request_id not in rows]
        if missing:
            raise ValueError(f"request '{missing[0]}' has an unread token that no step before "
                             "this one sampled")
        device = input_ids.device
        at = to_device(np.array([index for index, _ in wanted], dtype=np.int64), device)
        source = to_device(np.array([rows[r] for _, r in wanted], dtype=np.int64),
                           self.tokens.device)
        input_ids[at] = self.tokens[source].to(device)


def placeholder_inputs(states: list[RequestState], ends: list[int]) -> list[int]:
    """The rows whose input ends at an unread token (one per row at most, its last): row
    ``i`` computes positions up to ``ends[i]`` (exclusive)."""
    rows = []
    for row, (state, end) in enumerate(zip(states, ends, strict=True)):
        first_unread = len(state.token_ids) - state.num_placeholders
        if end <= first_unread:
            continue
        if end - 1 != first_unread or state.num_placeholders != 1:
            raise ValueError(f"request '{state.request_id}' computes {end - first_unread} "
                             "tokens the host has not read: only its last can come from the "
                             "step before")
        rows.append(row)
    return rows


def check_deferrable(step: StepInput) -> None:
    """A deferred step runs one decode step a call and verifies no drafts. Rows whose sampling
    reads their own tokens (penalties, a grammar) may be in it: their one unread token is
    read before they sample (``read_own_tokens``)."""
    if step.num_steps > 1:
        raise ValueError("a step whose read is deferred runs one decode step, not several")
    for item in step.scheduled:
        if item.draft_token_ids or item.num_model_drafts:
            raise ValueError(f"request '{item.request_id}' verifies drafts in a step whose "
                             "read is deferred")


def reads_own_tokens(state: RequestState) -> bool:
    return state.spec.uses_history or state.grammar is not None


def read_own_tokens(states: list[RequestState], previous: StepOutput) -> None:
    """Writes the step before's tokens over the placeholders of the rows whose sampling reads
    them (a grammar's matcher, the penalties' history): the host waits for that step's copy
    alone, while the device runs this step's forward. The placeholder count stays: the next
    step message brings the same tokens (``RequestState.apply``)."""
    rows = {request_id: row for row, request_id in enumerate(previous.request_ids)}
    for state in states:
        if not state.num_placeholders or not reads_own_tokens(state):
            continue
        row = rows.get(state.request_id)
        if row is None or state.num_placeholders != len(previous.token_ids[row]):
            raise ValueError(f"request '{state.request_id}' has {state.num_placeholders} "
                             "unread token(s) that the step before did not sample")
        first_unread = len(state.token_ids) - state.num_placeholders
        state.token_ids[first_unread:] = previous.token_ids[row]


def unread_inputs(unread: DeferredTokens | None, rows: DecodeRows,
                  states: dict[str, RequestState], device: torch.device) -> torch.Tensor | None:
    """The decode rows' input ids on the device with the unread tokens filled in; None when
    no row's input is unread (the host's ids go as they are)."""
    if unread is None:
        return None
    need = placeholder_inputs([states[r] for r in rows.request_ids],
                              (rows.positions + 1).tolist())
    if not need:
        return None
    input_ids = to_device(rows.input_ids.copy(), device)
    unread.fill(input_ids, [(row, rows.request_ids[row]) for row in need])
    return input_ids


def fill_unread(unread: DeferredTokens | None, input_ids: torch.Tensor,
                scheduled: list[ScheduledRequest], states: dict[str, RequestState]) -> None:
    """Fills a step's flattened input ids (on the device) where a row's last known token is
    unread: the row's last input before its drafts."""
    if unread is None:
        return
    known_ends = [item.num_computed_tokens + item.num_new_tokens - len(item.draft_token_ids)
                  for item in scheduled]
    need = placeholder_inputs([states[item.request_id] for item in scheduled], known_ends)
    if not need:
        return
    starts = np.cumsum([0] + [item.num_new_tokens for item in scheduled])
    unread.fill(input_ids, [
        (int(starts[row]) + known_ends[row] - scheduled[row].num_computed_tokens - 1,
         scheduled[row].request_id) for row in need])


def check_read(states: list[RequestState], ends: list[int]) -> None:
    """A step that cannot take unread inputs (several decode steps a call) gets none."""
    if placeholder_inputs(states, ends):
        raise ValueError("a call of several decode steps cannot start from a token the host "
                         "has not read")
