"""Builds the per-step message to the workers from the scheduler's decision (deltas only)."""

from kvstore.transfers import KVTransfers
from router.sampling_params import SamplingParams
from router.scheduler import SchedulerOutput
from workers.sampler import SamplingSpec
from workers.step_input import NewRequest, ScheduledRequest, StepInput


def sampling_spec(params: SamplingParams, stop_ids: frozenset[int]) -> SamplingSpec:
    """``stop_ids``: the tokens that end the sequence (``Sequence.stop_ids``), which the
    sampler masks until ``min_tokens``."""
    return SamplingSpec(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        seed=params.seed, logprobs=params.logprobs, min_tokens=params.min_tokens,
        stop_token_ids=tuple(sorted(stop_ids)) if params.min_tokens else (),
        logit_bias=tuple(sorted((params.logit_bias or {}).items())),
    )


class StepBuilder:
    def __init__(self) -> None:
        self.num_tokens_sent: dict[str, int] = {}  # how many of each request's tokens workers hold

    def build(self, output: SchedulerOutput, transfers: KVTransfers | None = None) -> StepInput:
        for request_id in output.released_ids:
            self.num_tokens_sent.pop(request_id, None)
        new_requests, scheduled = [], []
        sent = self.num_tokens_sent
        for item in output.scheduled:
            seq = item.seq
            request_id, token_ids = seq.request_id, seq.token_ids
            if item.is_new:
                new_requests.append(NewRequest(
                    request_id, list(token_ids), seq.num_prompt_tokens,
                    item.new_block_ids, sampling_spec(seq.params, seq.stop_ids), seq.grammar,
                ))
                new_tokens, new_blocks = [], []
            else:
                num_sent = sent[request_id]
                # a decode step sends the one token sampled last step
                new_tokens = token_ids[num_sent:] if num_sent < len(token_ids) else []
                new_blocks = item.new_block_ids
            sent[request_id] = len(token_ids)
            scheduled.append(ScheduledRequest(
                request_id, seq.num_computed_tokens, item.num_new_tokens, new_tokens, new_blocks,
                item.draft_token_ids, item.num_model_drafts,
            ))
        return StepInput(new_requests, scheduled, list(output.released_ids), output.num_steps,
                         output.lookahead, transfers)
