"""The messages between the engine and its workers: one small dataclass each way per step.

Workers keep each request's tokens and block table between steps, so a step carries only
deltas: a request is sent whole once (``NewRequest``), then only its newly sampled tokens
and newly allocated blocks (``ScheduledRequest``).
"""

from dataclasses import dataclass, field
from typing import Any

from kvstore.transfers import KVTransfers, TransferReport
from workers.sampler import SamplingSpec


@dataclass
class NewRequest:
    request_id: str
    token_ids: list[int]  # every token known so far: the prompt, plus outputs when resumed
    num_prompt_tokens: int
    block_ids: list[int]
    spec: SamplingSpec
    # the compiled grammar its output must match (workers/structured/backend.py GrammarRef)
    grammar: Any = None


@dataclass
class ScheduledRequest:
    """One sequence of the batch: compute tokens [num_computed, num_computed + num_new)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # appended since the last step
    new_block_ids: list[int] = field(default_factory=list)
    # speculative tokens after the known ones, the last of the num_new_tokens: verified in
    # this step (the worker samples at each of them and at the token before)
    draft_token_ids: list[int] = field(default_factory=list)
    # or how many drafts the worker's draft model makes first, greedily, to verify in this
    # step (workers/speculative/draft_model.py): the last num_new_tokens' too
    num_model_drafts: int = 0


@dataclass
class StepInput:
    new_requests: list[NewRequest]
    scheduled: list[ScheduledRequest]  # batch order
    released_ids: list[str]  # requests whose state the workers drop before this step
    # > 1: a pure-decode batch runs this many steps back to back on the device, each fed the
    # tokens the one before it sampled, with one read of all of them at the end
    num_steps: int = 1
    # with num_steps > 1: run the next call's first step too, into the slot allocated after
    # this call's (router/scheduler.py); kept for the next call if it continues from there
    lookahead: bool = False
    # copies between the device cache and the host and disk tiers, around this step's forward
    transfers: KVTransfers | None = None
    # async scheduling (workers/deferred_tokens.py): keep this step's tokens on the device and
    # return them with the next call, which runs before the host knows them
    defer_read: bool = False


TokenLogprobs = list[tuple[int, float]]  # [(token_id, logprob), ...]: sampled token, then top-n


@dataclass
class StepOutput:
    """One row per sequence that reached its last token and sampled: its tokens in step order
    (one per step of the call, or the accepted drafts and one more after a verify step), with
    their logprobs when asked for."""

    request_ids: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]] | None = None  # per row, per token
    # the KV copies between tiers finished since the last step (loads landed, failures)
    transfers: TransferReport | None = None
    # (request id, why) of rows whose output broke their grammar: the engine fails them
    grammar_failures: list[tuple[str, str]] = field(default_factory=list)
    # tokens the draft model caught up on before drafting (router/speculation.py prices them)
    draft_catch_up_tokens: int = 0
    # the tokens of the step before, whose read was deferred (StepInput.defer_read): read
    # once this call's step was on its way
    previous: "StepOutput | None" = None
