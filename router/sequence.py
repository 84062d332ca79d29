"""A request's state inside the scheduler: token counters plus a status."""

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from router.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """``num_computed_tokens`` catches up with ``num_tokens``; nothing else has phases.

    A prefill is many tokens to catch up, a decode one, a chunk some; a prefix hit moves
    ``num_computed_tokens`` forward for free and a preemption moves it back to zero.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache (first schedule)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(init=False)
    stop_ids: frozenset[int] = field(init=False)
    first_scheduled_time: float | None = None
    # proposed for the next step (speculative decoding): verified there, never cached unless
    # accepted; dropped when the sequence is preempted
    spec_token_ids: list[int] = field(default_factory=list)
    # or how many a draft model makes for it at the start of the next step, in the worker
    # (the tokens are known there only); dropped on preemption too
    num_model_drafts: int = 0
    # the compiled grammar of params.structured_outputs, once compiled (the engine's)
    grammar: Any = None
    # tokens sampled in a step still in flight (async scheduling), not yet in token_ids: the
    # next step is scheduled as if they were (router/scheduler.py ``launched``)
    num_pending: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        self.stop_ids = eos | frozenset(self.params.stop_token_ids)  # tokens that end it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def needs_single_steps(self) -> bool:
        """Each step's sampling reads what the step before gave: penalties read the history,
        min_tokens masks the stop tokens until the output is long enough, and drafts are
        verified in a step of their own. (A grammar's mask needs the token before it too, but
        the sampling worker reads each step's tokens during a call: ``masks_each_token``.)"""
        return self.samples_one_at_a_time or bool(self.spec_token_ids) or \
            self.num_model_drafts > 0

    @property
    def samples_one_at_a_time(self) -> bool:
        """Its next token's sampling reads the token before it (penalties, min_tokens): in a
        call of several decode steps it keeps the first step's token alone
        (router/scheduler.py, the rows that ride along)."""
        return self.params.uses_history or self.num_output_tokens < self.params.min_tokens

    @property
    def masks_each_token(self) -> bool:
        """A grammar masks its every token: the sampling worker reads each step's tokens in a
        call of several steps and fills the next mask while the next forward runs
        (workers/worker.py), so its row keeps every step's token; no lookahead step follows
        such a call (its mask would need the call's last token)."""
        return self.params.structured_outputs is not None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
