"""Overload control: a new request is refused at once when every replica's queue is full.

A replica's queue is what the router placed there that has no first token yet (waiting to be
scheduled, or prefilling): the requests, and their prompt tokens not expected cached. Past a
limit, placing one more only makes every queued request later; the client is better told to
come back (503 with Retry-After) than left waiting. A request continued after its replica was
lost was admitted already and is never refused here.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.placement import ReplicaLoad, candidates


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int = 0  # per replica; 0: no limit
    max_waiting_tokens: int = 0  # per replica, prompt tokens; 0: no limit

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 0 or self.max_waiting_tokens < 0:
            raise ValueError("admission limits must be >= 0 (0: no limit), got "
                             f"{self.max_waiting_requests} requests and "
                             f"{self.max_waiting_tokens} tokens")

    def has_room(self, load: ReplicaLoad, num_prompt_tokens: int) -> bool:
        if self.max_waiting_requests and load.num_prefilling >= self.max_waiting_requests:
            return False
        # a prompt longer than the whole limit still gets in when nothing else waits, or it
        # could never be served
        return not (self.max_waiting_tokens and load.num_prefilling
                    and load.num_prefill_tokens + num_prompt_tokens > self.max_waiting_tokens)


@dataclass(frozen=True)
class Refusal:
    """Why the router placed a request nowhere: ``overloaded`` (every queue full) or
    ``draining`` (the server is shutting down)."""

    reason: str


def admissible(loads: Sequence[ReplicaLoad], limits: AdmissionLimits,
               num_prompt_tokens: int) -> list[ReplicaLoad] | None:
    """The loads a placement policy may choose from (a full replica shows as unavailable), or
    None when every replica that could take the request is full."""
    pool = candidates(loads)
    open_ = {index for index in pool if limits.has_room(loads[index], num_prompt_tokens)}
    if not open_:
        return None
    return [replace(load, alive=index in open_) for index, load in enumerate(loads)]
