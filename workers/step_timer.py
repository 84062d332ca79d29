"""Each prefill or loading step's cost on whichever of the host and the device bounds it, for
the prices of loads against recomputes (router/live_rates.py). On a GPU only: on the CPU the
measured copies and the start-up prefill rate price the loads (so the tests' loads do not
depend on the machine's speed).

A pair of CUDA events on the compute stream around the step's copies, forward and stores: the
first fires when the device gets to the step (after the step before), the second when it has
done the step's work, so the span is the device's time for the step, or, where the device ran
ahead and waited for the host's launches, the host's. Neither event is waited for: a step's
cost is reported once its second event has fired (``take``), a step or two later.
"""

from collections import deque

import torch

from kvstore.transfers import StepCost
from workers.step_input import StepInput


def prompt_tokens(step: StepInput) -> int:
    """Tokens of the step's rows that compute more than their next token and drafts."""
    return sum(item.num_new_tokens for item in step.scheduled
               if item.num_new_tokens > 1 + len(item.draft_token_ids) + item.num_model_drafts)


def loaded_blocks(step: StepInput) -> int:
    """Blocks the step's message loads from the host tier before its forward."""
    if step.transfers is None:
        return 0
    return sum(len(load.block_ids) for load in step.transfers.loads)


class StepTimer:
    def __init__(self) -> None:
        # what the step started last ran (prompt tokens, tokens, loaded blocks) and its first
        # event; None: a step of decodes alone, not timed (no event on the decode path)
        self._started: tuple[tuple[int, int, int], torch.cuda.Event] | None = None
        # each timed step's counts and its two events, oldest first
        self._in_flight: deque[tuple[tuple[int, int, int], torch.cuda.Event,
                                     torch.cuda.Event]] = deque()

    def start(self, step: StepInput) -> None:
        """Times ``step`` if it computes prompt tokens or loads blocks (a prompt whose every
        full block loads runs its last token alone)."""
        num_prompt, num_loaded = prompt_tokens(step), loaded_blocks(step)
        self._started = None
        if not (num_prompt or num_loaded):
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        total = sum(item.num_new_tokens for item in step.scheduled)
        self._started = ((num_prompt, total, num_loaded), event)

    def stop(self) -> None:
        """The step started last ends here."""
        started, self._started = self._started, None
        if started is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._in_flight.append((*started, end))

    def take(self) -> list[StepCost]:
        """The timed steps that have finished since the last call, in the order they ran."""
        done = []
        while self._in_flight and self._in_flight[0][2].query():
            ran, start, end = self._in_flight.popleft()
            done.append(StepCost(*ran, start.elapsed_time(end) / 1e3))
        return done
