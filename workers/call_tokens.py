"""A call of several decode steps whose rows include a grammar's: each step's tokens read
while the next step's forward runs.

A grammar's mask for step k needs the token of step k - 1. The sampling worker queues that
token's copy to pinned host memory right after sampling it, before the next forward; when
step k's logits are queued it waits for that copy alone (done long before the forward it runs
beside), gives each grammar row its token (``RequestState.add_read``) and fills the mask, so
the device waits for the host only if the mask takes longer than a forward. The call's tokens
are still read together at its end; the next step message writes the same tokens over the
placeholders.
"""

import torch

from workers.pending import copied_event, to_host
from workers.request_state import RequestState


class CallTokens:
    def __init__(self, states: list[RequestState]) -> None:
        # a grammar's rows that keep every token of the call (not those riding along for
        # their penalties or min_tokens, whose later tokens the engine drops)
        self.rows = [(row, state) for row, state in enumerate(states)
                     if state.grammar is not None and not state.needs_single_steps]
        self.request_ids = {state.request_id for _, state in self.rows}
        self.host: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def start(self, tokens: torch.Tensor) -> None:
        """The copy of a step's sampled tokens (B,), queued behind the sampling."""
        self.host, self.copied = to_host(tokens), copied_event(tokens)

    def finish(self) -> None:
        """Each grammar row's token of the step whose copy was started last."""
        if self.host is None:
            raise ValueError("a step's tokens were asked for before its copy was started")
        if self.copied is not None:
            self.copied.synchronize()
        values = self.host.tolist()
        for row, state in self.rows:
            state.add_read(values[row])
        self.host = None
