"""Continuing a request another replica started: its prompt plus the tokens it already sent.

A resumed request enters the engine as a sequence that was preempted by recompute: its
emitted tokens are output tokens already (``num_prompt_tokens`` is the original prompt's), so
the prefill computes them again and the scheduler, the sampler and the detokenizer count them
as they counted them on the first replica. That is what keeps the continuation exact:

- ``max_tokens``, ``min_tokens`` and the penalties see the same output history, so the
  remaining budget and the penalised logits are the same;
- a seeded request's noise is drawn from (seed, output index) (``RequestState.
  generator_for_next_token``), not from a stream that ran on the lost replica, so its next
  token is drawn with the same noise; an unseeded sampled request continues from this
  engine's shared generator, distributed the same but not the same tokens (no one could
  reproduce those);
- the detokenizer and the stop-string hold-back are fed the emitted tokens one by one first,
  so the text they release next continues the text the client has, byte for byte.
"""

import time
from dataclasses import dataclass

from cluster.engine.output_processor import RequestTracker, add_token
from cluster.engine.outputs import RequestOutput
from router.sampling_params import SamplingParams
from router.sequence import Sequence


@dataclass(frozen=True)
class ResumedCompletion:
    token_ids: tuple[int, ...]  # what the client already has of this completion
    finish_reason: str | None = None  # set when this one of n had finished already
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Resume:
    completions: tuple[ResumedCompletion, ...]  # by completion index, all n of them
    # seconds since the request arrived: a duration, because clocks of two nodes differ
    elapsed_s: float = 0.0

    @classmethod
    def from_output(cls, output: RequestOutput, elapsed_s: float) -> "Resume":
        return cls(tuple(ResumedCompletion(tuple(c.token_ids), c.finish_reason, c.stop_reason)
                         for c in output.outputs), elapsed_s)

    def check(self, params: SamplingParams) -> None:
        if len(self.completions) != params.n:
            raise ValueError(f"a resumed request carries {len(self.completions)} completions "
                             f"for n = {params.n}")
        for index, completion in enumerate(self.completions):
            if completion.finish_reason is None and len(completion.token_ids) >= \
                    params.max_tokens:
                raise ValueError(f"completion {index} of a resumed request has "
                                 f"{len(completion.token_ids)} tokens and no finish reason, "
                                 f"with max_tokens = {params.max_tokens}")


def prime(tracker: RequestTracker, resume: Resume, params: SamplingParams) -> None:
    """Puts the emitted tokens through the request's output tracking as if this engine had
    sampled them, and marks them sent: its next delta carries only what is new."""
    for completion, done in zip(tracker.completions.values(), resume.completions, strict=True):
        for token_id in done.token_ids:
            # the logprobs of those tokens were sent already; an empty entry keeps later
            # entries at their tokens' positions
            add_token(completion, params, token_id, [] if params.logprobs is not None else None)
        completion.output.finish_reason = done.finish_reason
        completion.output.stop_reason = done.stop_reason
        completion.delta(params)  # everything so far counts as sent
    tracker.prompt_sent = True  # the client has the prompt
    now = time.monotonic()
    # its first token was long ago: no second time-to-first-token for it, and its latency
    # counts from when it first arrived
    tracker.metrics.arrival_time = now - resume.elapsed_s
    tracker.metrics.first_token_time = now


def resumed_sequence(seq: Sequence, done: ResumedCompletion) -> Sequence:
    """``seq`` with the completion's emitted tokens as its output so far, none computed."""
    seq.token_ids.extend(done.token_ids)
    return seq
