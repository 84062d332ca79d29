"""Speculative decoding in the engine: drafts proposed between steps, what verification kept
counted, and how many drafts each sequence tries next (router/speculation.py).

Prompt lookup proposes on the host from the sequence's own tokens; a draft model proposes in
the worker, after each step. Either way a draft is only a scheduled token to the workers: under
tensor parallelism, preemption (drafts dropped), chunked prefill (a prompt drafts nothing) and
prefix hits nothing else changes.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from cluster.engine.metrics import EngineMetrics
from router.scheduler import SchedulerOutput
from router.sequence import Sequence as Seq
from router.speculation import DraftLength
from workers.speculative.config import SpeculativeConfig
from workers.speculative.ngram import ngram_drafts
from workers.step_input import StepInput, StepOutput


def can_speculate(seq: Seq) -> bool:
    """Decoding, and nothing its sampling reads that drafts would change: penalties (the
    history), logprobs (reported for sampled tokens only) or min_tokens still masking."""
    params = seq.params
    return (seq.num_tokens - seq.num_computed_tokens == 1 and not params.uses_history
            and params.logprobs is None and seq.num_output_tokens >= params.min_tokens)


class Proposer(Protocol):
    def propose(self, seq: Seq, num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` guesses of the tokens after ``seq.token_ids``."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seq: Seq, num_drafts: int) -> list[int]:
        return ngram_drafts(seq.token_ids, num_drafts, self.min_n, self.max_n)


class DraftModelProposer:
    """The draft model runs in the worker, after the target's step (workers/speculative/
    draft_model.py): its proposals come back with the step's tokens."""

    def __init__(self) -> None:
        self.latest: dict[str, list[int]] = {}

    def receive(self, result: StepOutput) -> None:
        drafts = result.draft_token_ids or [[] for _ in result.request_ids]
        self.latest = dict(zip(result.request_ids, drafts, strict=True))

    def propose(self, seq: Seq, num_drafts: int) -> list[int]:
        return self.latest.get(seq.request_id, [])[:num_drafts]


class DraftActorProposer(DraftModelProposer):
    """The draft model in an actor of its own (cluster/ray/draft_actor.py): it is sent each
    step as the workers are, and asked for drafts once the step's tokens are known."""

    def __init__(self, actor, replica: str) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.actor, self.replica = actor, replica
        self.following = None  # the step the actor is running, beside the target's

    def before_step(self, step: StepInput) -> None:
        self.following = self.actor.step.remote(self.replica, step)

    def receive(self, result: StepOutput) -> None:
        import ray

        drafts = self.actor.propose.remote(self.replica, result.request_ids, result.token_ids)
        if self.following is not None:
            ray.get(self.following)  # raises what the actor's step raised
            self.following = None
        self.latest = dict(zip(result.request_ids, ray.get(drafts), strict=True))


class Speculator:
    def __init__(self, config: SpeculativeConfig, metrics: EngineMetrics,
                 draft_model: DraftModelProposer | None = None) -> None:
        """``draft_model``: where a draft model's proposals come from (by default, when the
        config names a model, the target's worker)."""
        self.config = config
        self.metrics = metrics
        self.lengths = DraftLength(config.num_speculative_tokens, config.adaptive)
        if draft_model is None and config.model is not None:
            draft_model = DraftModelProposer()
        self.draft_model = draft_model
        self.proposer: Proposer = self.draft_model or NgramProposer(config)

    def before_step(self, step: StepInput) -> None:
        """The step's message, as the workers get it (a draft actor follows the step)."""
        if isinstance(self.draft_model, DraftActorProposer):
            self.draft_model.before_step(step)

    def receive(self, result: StepOutput) -> None:
        """A step's result: the draft model's proposals in it, when there is one."""
        if self.draft_model is not None:
            self.draft_model.receive(result)

    def propose(self, running: Sequence[Seq]) -> None:
        """Sets each running sequence's drafts for the next step."""
        batch = len(running)
        for seq in running:
            if not can_speculate(seq):
                continue
            k = self.lengths.choose(seq.request_id, batch)
            if k:
                seq.spec_token_ids = self.proposer.propose(seq, k)

    def observe(self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]],
                seconds: float) -> None:
        """A step's verify results, and its cost when it was one of decodes and verifies."""
        metrics, decodes_only = self.metrics, True
        for item in output.scheduled:
            drafts = item.draft_token_ids
            decodes_only &= item.num_new_tokens - len(drafts) == 1 and not item.is_new
            if not drafts or item.seq.request_id not in sampled:
                continue
            kept = len(sampled[item.seq.request_id]) - 1
            metrics.spec_decode_drafts += 1
            metrics.spec_decode_draft_tokens += len(drafts)
            metrics.spec_decode_accepted_tokens += kept
            per_position = metrics.spec_decode_accepted_per_position
            per_position.extend([0] * (len(drafts) - len(per_position)))
            for position in range(kept):
                per_position[position] += 1
            self.lengths.record(item.seq.request_id, len(drafts), kept)
        if decodes_only and output.num_steps == 1 and output.scheduled:
            num_tokens = sum(item.num_new_tokens for item in output.scheduled)
            self.lengths.cost.add(num_tokens, seconds)
            self._time_against_plain(output, sampled, seconds)

    def _time_against_plain(self, output: SchedulerOutput,
                            sampled: Mapping[str, Sequence[int]], seconds: float) -> None:
        """The measured speedup: a verify step's time against what plain steps of the same
        batch would have taken for the tokens it made (from the fitted step cost)."""
        fitted = self.lengths.cost.fit()
        if fitted is None or not any(item.draft_token_ids for item in output.scheduled):
            return
        a, b = fitted
        batch = len(output.scheduled)
        made = sum(len(sampled.get(item.seq.request_id, ())) for item in output.scheduled)
        self.metrics.spec_decode_plain_seconds += made * (a + b * batch) / batch
        self.metrics.spec_decode_verify_seconds += seconds

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.lengths.forget(request_id)
