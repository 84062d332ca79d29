"""Speculative decoding in the engine: how many drafts each sequence tries next step
(router/speculation.py), where the drafts come from, and what verification kept, counted.

Prompt lookup proposes on the host from the sequence's own tokens. A draft model proposes at
the start of the step that verifies its drafts, only for the rows that draft and only as many
as chosen: in the target's worker (the step asks for ``num_model_drafts``) or in its actor
(asked here before the step goes to the workers). Either way a draft is only a scheduled
token to the workers, and a step in which nobody drafts is the plain engine's step.
"""

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from cluster.engine.metrics import EngineMetrics
from router.scheduler import SchedulerOutput
from router.sequence import Sequence as Seq
from router.speculation import DraftLength
from workers.speculative.config import SpeculativeConfig
from workers.speculative.draft_follower import DraftRow
from workers.speculative.ngram import ngram_drafts
from workers.step_input import StepInput


def can_speculate(seq: Seq) -> bool:
    """Decoding, and nothing its sampling reads that drafts would change: penalties (the
    history), logprobs (reported for sampled tokens only) or min_tokens still masking."""
    params = seq.params  # a token in flight (async scheduling) is its next step's input
    return (seq.num_tokens + seq.num_pending - seq.num_computed_tokens == 1
            and not params.uses_history
            and params.logprobs is None and seq.num_output_tokens >= params.min_tokens)


class Proposer(Protocol):
    def ask(self, seq: Seq, num_drafts: int) -> None:
        """Up to ``num_drafts`` guesses of the tokens after ``seq.token_ids`` for its next
        step: in ``seq.spec_token_ids``, or asked of a draft model (``num_model_drafts``)."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def ask(self, seq: Seq, num_drafts: int) -> None:
        seq.spec_token_ids = ngram_drafts(seq.token_ids, num_drafts, self.min_n, self.max_n)


class DraftModelProposer:
    """The draft model in the target's worker (workers/speculative/draft_model.py)."""

    def ask(self, seq: Seq, num_drafts: int) -> None:
        seq.num_model_drafts = num_drafts

    def before_step(self, step: StepInput) -> StepInput:
        return step


class DraftActorProposer(DraftModelProposer):
    """The draft model in an actor of its own (cluster/ray/draft_actor.py). A step with rows
    that draft is held until the actor has drafted for them; it is sent each row's tokens and
    blocks gained since that row last drafted, which this keeps from the steps' messages (the
    workers' own deltas), so a step without drafts costs the actor nothing."""

    def __init__(self, actor, replica: str) -> None:  # type: ignore[no-untyped-def]
        self.actor, self.replica = actor, replica
        self.tokens: dict[str, list[int]] = {}  # as the workers hold them
        self.blocks: dict[str, list[int]] = {}
        self.sent: dict[str, tuple[int, int]] = {}  # tokens and blocks the actor holds
        self.released: list[str] = []  # requests the actor still holds, gone since

    def before_step(self, step: StepInput) -> StepInput:
        import ray

        self._follow(step)
        wanted = [index for index, item in enumerate(step.scheduled) if item.num_model_drafts]
        if not wanted:
            return step
        rows = [self._row(step.scheduled[index].request_id,
                          step.scheduled[index].num_model_drafts) for index in wanted]
        released, self.released = self.released, []
        drafts = ray.get(self.actor.draft.remote(self.replica, rows, released))
        scheduled = list(step.scheduled)
        for index, row in zip(wanted, drafts, strict=True):
            scheduled[index] = replace(scheduled[index], num_model_drafts=0,
                                       draft_token_ids=scheduled[index].draft_token_ids or row)
        return replace(step, scheduled=scheduled)

    def _follow(self, step: StepInput) -> None:
        for request_id in step.released_ids:
            self.tokens.pop(request_id, None)
            self.blocks.pop(request_id, None)
            if self.sent.pop(request_id, None) is not None:
                self.released.append(request_id)
        for request in step.new_requests:
            self.tokens[request.request_id] = list(request.token_ids)
            self.blocks[request.request_id] = list(request.block_ids)
        for item in step.scheduled:
            self.tokens[item.request_id] += item.new_token_ids
            self.blocks[item.request_id] += item.new_block_ids

    def _row(self, request_id: str, num_drafts: int) -> DraftRow:
        tokens, blocks = self.tokens[request_id], self.blocks[request_id]
        fresh = request_id not in self.sent
        num_tokens, num_blocks = self.sent.get(request_id, (0, 0))
        self.sent[request_id] = (len(tokens), len(blocks))
        return DraftRow(request_id, tokens[num_tokens:], blocks[num_blocks:], num_drafts,
                        fresh)


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

    def before_step(self, step: StepInput) -> StepInput:
        """The step's message as the workers get it: with a draft actor's drafts in it."""
        if self.draft_model is None:
            return step
        return self.draft_model.before_step(step)

    def runs_ahead(self, running: Sequence[Seq]) -> bool:
        """Whether the next step may be scheduled before this one is read (async
        scheduling): no sequence holds drafts and the next choice drafts nothing for any that
        may draft, all of them known to it (quiet until a try's step). Else the engine reads
        first, so drafts are asked of a sequence's known tokens."""
        lengths = self.lengths
        if not lengths.quiet_next():
            return False
        return not any(seq.spec_token_ids or seq.num_model_drafts or (
            can_speculate(seq) and seq.request_id not in lengths.seqs) for seq in running)

    def propose(self, running: Sequence[Seq]) -> None:
        """Sets how many drafts each running sequence tries next step, and asks for them."""
        candidates = [seq for seq in running if can_speculate(seq)]
        if not candidates:
            return
        chosen = self.lengths.choose([seq.request_id for seq in candidates], len(running),
                                     [seq.num_tokens for seq in candidates])
        asked, started = 0, time.perf_counter()
        for seq in candidates:
            k = chosen[seq.request_id]
            if k:
                self.proposer.ask(seq, k)
                asked += 1
        if self.draft_model is None:  # prompt lookup's search is host time of its own
            self.lengths.observe_proposer(time.perf_counter() - started, asked)

    def observe(self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]],
                seconds: float, catch_up_tokens: int = 0) -> None:
        """A step's verify results, and its cost when it was one of decodes and verifies
        (``catch_up_tokens``: those the draft model caught up on in it)."""
        metrics, decodes_only, verifies = self.metrics, True, False
        draft_tokens = draft_steps = 0
        for item in output.scheduled:
            num_drafts = item.num_drafts
            decodes_only &= item.num_new_tokens - num_drafts == 1 and not item.is_new
            verifies |= num_drafts > 0
            if not num_drafts or item.seq.request_id not in sampled:
                continue
            kept = len(sampled[item.seq.request_id]) - 1
            metrics.spec_decode_drafts += 1
            metrics.spec_decode_draft_tokens += num_drafts
            metrics.spec_decode_accepted_tokens += kept
            per_position = metrics.spec_decode_accepted_per_position
            per_position.extend([0] * (num_drafts - len(per_position)))
            for position in range(kept):
                per_position[position] += 1
            self.lengths.record(item.seq.request_id, num_drafts, kept)
            if item.num_model_drafts:  # the draft model's work is in this step's time
                draft_tokens += num_drafts
                draft_steps = max(draft_steps, num_drafts)
        if not decodes_only or not output.scheduled:
            return
        num_steps = output.num_steps
        num_tokens = sum(item.num_new_tokens for item in output.scheduled)
        self.lengths.costs.add(seconds, num_steps, num_tokens * num_steps, int(verifies),
                               draft_steps, draft_tokens, catch_up_tokens)
        self._time_against_plain(output, sampled, seconds)

    def _time_against_plain(self, output: SchedulerOutput,
                            sampled: Mapping[str, Sequence[int]], seconds: float) -> None:
        """The measured speedup: a verify step's time against what plain steps of the same
        batch would have taken for the tokens it made (from the fitted step cost)."""
        if not any(item.num_drafts for item in output.scheduled):
            return
        fitted = self.lengths.costs.fit()
        if fitted is None:
            return
        a, b = fitted.a, fitted.b
        batch = len(output.scheduled)
        made = sum(len(sampled.get(item.seq.request_id, ())) for item in output.scheduled)
        self.metrics.spec_decode_plain_seconds += made * (a + b * batch) / batch
        self.metrics.spec_decode_verify_seconds += seconds

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.lengths.forget(request_id)
