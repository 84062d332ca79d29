"""What a worker call leaves on its way: a call's tokens copied to the host (``PendingRead``)
and the lookahead step run for the next call (``Lookahead``)."""

from dataclasses import dataclass

import numpy as np
import torch

from workers.input_batch import DecodeRows
from workers.request_state import RequestState
from workers.sampler import SamplerOutput
from workers.step_input import StepOutput, TokenLogprobs


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued without waiting (into pinned memory from a GPU)."""
    return tensor.to("cpu", non_blocking=True)


def copied_event(source: torch.Tensor) -> "torch.cuda.Event | None":
    """Marks the copies from source's GPU queued so far on the current stream; None on the
    CPU, where they are done already."""
    if not source.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


@dataclass
class PendingRead:
    """A call's tokens (and logprobs) on their way to the host."""

    request_ids: list[str]
    token_ids: torch.Tensor  # (B, steps) on the host once `copied` has passed
    logprobs: list[tuple[torch.Tensor, torch.Tensor]] | None  # a step's (values, token ids)
    widths: list[int]  # per row: the sampled token's logprob and its top ones
    copied: "torch.cuda.Event | None"

    def result(self) -> StepOutput:
        if self.copied is not None:
            self.copied.synchronize()
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return StepOutput(self.request_ids, token_ids)
        logprobs: list[list[TokenLogprobs]] = [[] for _ in self.request_ids]
        for values, ids in self.logprobs:
            values_rows, ids_rows = values.tolist(), ids.tolist()
            for row, width in enumerate(self.widths):
                logprobs[row].append(list(zip(ids_rows[row][:width], values_rows[row][:width],
                                              strict=True)))
        return StepOutput(self.request_ids, token_ids, logprobs)


@dataclass
class ReadDone:
    """A read with nothing to wait for: a deferred step that sampled no row."""

    output: StepOutput

    def result(self) -> StepOutput:
        return self.output


@dataclass
class Lookahead:
    """The first step of the next call, run at the end of this one (``StepInput.lookahead``)."""

    request_ids: list[str]
    positions: np.ndarray  # (B,) the positions its inputs took
    tokens: torch.Tensor  # (B,) on the device: its samples, every rank
    output: SamplerOutput | None  # the driver's; None on other ranks

    def rows_continued_by(self, rows: DecodeRows) -> np.ndarray | None:
        """Each of ``rows``' row in this lookahead, when every one continues it (a sequence it
        stepped, at the position it stepped); else None. The rows of sequences that have
        finished since are left out."""
        row_of = {request_id: row for row, request_id in enumerate(self.request_ids)}
        picks = np.array([row_of.get(request_id, -1) for request_id in rows.request_ids],
                         dtype=np.int64)
        if (picks < 0).any() or not np.array_equal(self.positions[picks], rows.positions):
            return None
        return picks

    def taken_up(self, picks: np.ndarray) -> tuple[torch.Tensor, SamplerOutput | None]:
        """(tokens, output) of the rows ``picks`` (rows_continued_by), in their order."""
        if np.array_equal(picks, np.arange(len(self.request_ids))):
            return self.tokens, self.output
        index = torch.from_numpy(picks)
        if self.tokens.is_cuda:  # a blocking copy would wait for the lookahead step itself
            index = index.pin_memory()
        index = index.to(self.tokens.device, non_blocking=True)
        output = self.output.rows(index) if self.output is not None else None
        return self.tokens[index], output


def check_lookahead_slots(first: DecodeRows, num_steps: int, states: dict[str, RequestState],
                          block_size: int) -> None:
    """The lookahead's K/V goes into a slot the scheduler allocated to the same sequence; a
    row without one would write into another sequence's block."""
    blocks = (first.positions + num_steps) // block_size
    for request_id, block in zip(first.request_ids, blocks.tolist(), strict=True):
        if block >= len(states[request_id].block_ids):
            raise ValueError(f"no slot allocated for the lookahead step of '{request_id}'")
