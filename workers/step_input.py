"""The messages between the engine and its workers: one small dataclass each way per step.

Workers keep each request's tokens and block table between steps, so a step carries only
deltas: a request is sent whole once (``NewRequest``), then only its newly sampled tokens
and newly allocated blocks (``ScheduledRequest``).
"""

from dataclasses import dataclass, field

from workers.sampler import SamplingSpec


@dataclass
class NewRequest:
    request_id: str
    token_ids: list[int]  # every token known so far: the prompt, plus outputs when resumed
    num_prompt_tokens: int
    block_ids: list[int]
    spec: SamplingSpec


@dataclass
class ScheduledRequest:
    """One sequence of the batch: compute tokens [num_computed, num_computed + num_new)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # appended since the last step
    new_block_ids: list[int] = field(default_factory=list)


@dataclass
class StepInput:
    new_requests: list[NewRequest]
    scheduled: list[ScheduledRequest]  # batch order
    released_ids: list[str]  # requests whose state the workers drop before this step


@dataclass
class StepOutput:
    """One row per sequence that reached its last token this step and sampled."""

    request_ids: list[str]
    token_ids: list[int]
    # per row: [(token_id, logprob), ...], the sampled token first, then the top-n
    logprobs: list[list[tuple[int, float]]] | None = None
    ranks: list[int] | None = None
