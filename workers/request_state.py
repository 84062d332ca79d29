"""What a worker remembers of each request between steps."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.sampler import SamplingSpec, make_generator
from workers.step_input import NewRequest, ScheduledRequest

PLACEHOLDER = 0  # a valid token id: a row that was not filled still embeds without a fault

if TYPE_CHECKING:
    from workers.structured.row_grammar import RowGrammar


@dataclass
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    spec: SamplingSpec
    generator: torch.Generator | None
    request_id: str = ""
    grammar: "RowGrammar | None" = None  # on the worker that samples (rank 0) only
    # the last tokens, sampled in a step whose read was deferred (workers/deferred_tokens.py):
    # their places hold a placeholder until a step message brings the real ones
    num_placeholders: int = 0

    @classmethod
    def from_new(cls, request: NewRequest, device: torch.device,
                 samples: bool = True) -> "RequestState":
        """``samples``: this worker samples (rank 0), so it keeps the row's grammar matcher."""
        seed = request.spec.seed
        generator = None if seed is None else make_generator(seed, device)
        grammar = None
        if request.grammar is not None and samples:
            from workers.structured.row_grammar import RowGrammar

            grammar = RowGrammar(request.grammar.compiled, request.grammar.and_row)
        return cls(
            list(request.token_ids), request.num_prompt_tokens, list(request.block_ids),
            request.spec, generator, request.request_id, grammar,
        )

    def apply(self, delta: ScheduledRequest) -> None:
        """The step's new tokens go over the placeholders first, then after them."""
        new = delta.new_token_ids
        if new:
            first_unread = len(self.token_ids) - self.num_placeholders
            self.token_ids[first_unread : first_unread + len(new)] = new
            self.num_placeholders = max(0, self.num_placeholders - len(new))
        self.block_ids.extend(delta.new_block_ids)

    def add_placeholder(self) -> None:
        """A token was sampled and left on the device (a deferred read)."""
        self.token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def add_read(self, token_id: int) -> None:
        """A token sampled earlier in this call, read by the sampling worker for its grammar
        (workers/worker.py): held as a placeholder, which the next step message writes
        over with the same token."""
        self.add_placeholder()
        self.token_ids[-1] = token_id

    @property
    def needs_single_steps(self) -> bool:
        """Sampling reads every token before (penalties) or masks stops until min_tokens: in
        a call of several steps its later samples are not kept. (A grammar's row reads its
        tokens during the call instead: ``add_read``.)"""
        num_output = len(self.token_ids) - self.num_prompt_tokens
        return self.spec.uses_history or num_output < self.spec.min_tokens

    def generator_for_next_token(self, offset: int = 0) -> torch.Generator | None:
        """The seeded generator, reseeded from (seed, output index); ``offset`` counts tokens
        sampled past those this state holds (the later steps of a multi-step call).

        Tying the noise to the token's index rather than to a stream that runs across steps
        keeps a seeded request reproducible even when it is preempted and recomputed.
        """
        if self.generator is None or self.spec.seed is None:
            return None
        return self.generator.manual_seed(hash_seed(self.spec.seed,
                                                          len(self.output_token_ids) + offset))


class TokenHistory(Sequence[list[int]]):
    """One list of token ids per request (its prompt, or its output so far), copied out of the
    state only when read. The sampler reads them for penalties alone; copying every request's
    prompt at every step took ~2 ms of host time a W2 decode call (225 requests x 8 steps)."""

    def __init__(self, states: Sequence[RequestState],
                 part: Callable[[RequestState], list[int]]) -> None:
        self.states, self.part = states, part

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self.part(state) for state in self.states[index]]
        return self.part(self.states[index])


def hash_seed(seed: int, index: int) -> int:
    # a fixed 64-bit mix (splitmix64), the same in every process
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
