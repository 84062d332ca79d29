"""A draft model that keeps its own copy of the requests' state, for a draft that runs in a
process of its own (cluster/ray/draft_actor.py) rather than inside the target's worker.

It receives the same step messages as the target's workers and keeps the same request
states (tokens, block ids) from them, so it runs over exactly the tokens the target runs over,
into the same slots of a cache indexed by the target's block ids: a rejected draft's K/V sits
where the next step writes again, and prefix hits, preemption and chunked prefill keep both
caches in step, as in the worker (workers/speculative/draft_model.py).
"""

from collections.abc import Sequence

import torch

from workers.input_batch import build_input_batch, build_verify_rows
from workers.request_state import RequestState
from workers.speculative.draft_model import DraftModel
from workers.step_input import StepInput


class DraftFollower:
    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft
        self.states: dict[str, RequestState] = {}

    @torch.inference_mode()
    def step(self, step: StepInput) -> None:
        """The target's step, through the draft: its K/V for the step's tokens."""
        for request_id in step.released_ids:
            self.states.pop(request_id, None)
        for request in step.new_requests:
            self.states[request.request_id] = RequestState.from_new(request, self.draft.device)
        for item in step.scheduled:
            self.states[item.request_id].apply(item)
        if not step.scheduled:
            return
        verify = build_verify_rows(step.scheduled, self.states, self.draft.block_size)
        if verify is not None:
            self.draft.follow_rows(verify.rows)
            return
        self.draft.follow(build_input_batch(step.scheduled, self.states, self.draft.block_size,
                                            self.draft.device))

    @torch.inference_mode()
    def propose(self, request_ids: Sequence[str], emitted: Sequence[list[int]]
                ) -> list[list[int]]:
        """Drafts after each row's known tokens and the ones the target ``emitted`` this step
        (not yet in the states: the next step's message brings them)."""
        states = [self.states[request_id] for request_id in request_ids]
        return self.draft.propose(states, list(emitted))
