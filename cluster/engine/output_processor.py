"""Turns sampled tokens into request outputs: text, stop strings, logprobs, metrics.

A request with ``n`` completions runs as ``n`` sequences; the tracker gathers them back.
Text is released with a hold-back of ``len(longest stop string) - 1`` characters until the
request finishes, so a stop string split across tokens never leaks into streamed text.
"""

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from cluster.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer
from cluster.engine.outputs import (
    CompletionDelta,
    CompletionOutput,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
)
from router.sampling_params import SamplingParams
from router.sequence import Sequence


@dataclass
class CompletionTracker:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | StreamDetokenizer | None
    full_text: str = ""
    last_token_time: float | None = None
    tokens_sent: int = 0  # how much of the completion earlier deltas carried
    text_sent: int = 0

    def delta(self, params: SamplingParams) -> CompletionDelta:
        c = self.output
        text = self.visible_text(params) if self.full_text else ""  # only grows: stop
        # strings are held back until ruled out
        logprobs = c.logprobs[self.tokens_sent :] if c.logprobs is not None else None
        delta = CompletionDelta(c.index, c.token_ids[self.tokens_sent :],
                                text[self.text_sent :], logprobs, c.finish_reason,
                                c.stop_reason)
        self.tokens_sent, self.text_sent = len(c.token_ids), len(text)
        return delta

    def visible_text(self, params: SamplingParams) -> str:
        if self.output.finished or not params.stop:
            return self.full_text
        hold = max(len(stop) for stop in params.stop) - 1
        return self.full_text[: max(len(self.full_text) - hold, 0)]


@dataclass
class RequestTracker:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: dict[str, CompletionTracker]  # sequence id -> its completion
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    prompt_sent: bool = False
    error: str | None = None  # the engine failed it: its completions are aborted

    @property
    def finished(self) -> bool:
        for completion in self.completions.values():
            if completion.output.finish_reason is None:
                return False
        return True

    def snapshot(self) -> RequestOutput:
        outputs = []
        for tracker in self.completions.values():
            c = tracker.output
            outputs.append(CompletionOutput(
                c.index, list(c.token_ids), tracker.visible_text(self.params), c.finish_reason,
                c.stop_reason, list(c.logprobs) if c.logprobs is not None else None,
            ))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             self.metrics, self.finished, self.error)


    def delta(self) -> RequestDelta:
        """What changed since the last delta (a stream's message: no whole-list copies)."""
        delta = RequestDelta(self.request_id, [c.delta(self.params) for c in
                                               self.completions.values()],
                             self.metrics, self.finished, error=self.error)
        if not self.prompt_sent:
            delta.prompt, delta.prompt_token_ids = self.prompt, self.prompt_token_ids
            self.prompt_sent = True
        return delta


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last ``new_chars`` characters."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def make_tracker(
    request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
    seq_ids: list[str], tokenizer: PreTrainedTokenizerBase | None,
) -> RequestTracker:
    completions = {
        seq_id: CompletionTracker(
            CompletionOutput(index, logprobs=[] if params.logprobs is not None else None),
            IncrementalDetokenizer.for_prompt(tokenizer, prompt_ids) if tokenizer else None,
        )
        for index, seq_id in enumerate(seq_ids)
    }
    return RequestTracker(request_id, prompt, prompt_ids, params, completions)


def add_token(
    tracker: CompletionTracker, params: SamplingParams, token_id: int,
    logprobs: list[tuple[int, float]] | None,
) -> str | None:
    """Records one sampled token; returns the stop string it completed, if any."""
    tracker.output.token_ids.append(token_id)
    if tracker.output.logprobs is not None and logprobs is not None:
        tracker.output.logprobs.append(logprobs)
    if tracker.detokenizer is None:
        return None
    delta = tracker.detokenizer.add(token_id)
    tracker.full_text += delta
    if not params.stop or not delta or len(tracker.output.token_ids) <= params.min_tokens:
        return None  # (vLLM's rule: a stop string counts only past min_tokens)
    found = find_stop(tracker.full_text, len(delta), params.stop)
    if found is None:
        return None
    at, stop = found
    tracker.full_text = tracker.full_text[:at]  # the stop string never reaches the output
    return stop


def finish_completion(tracker: CompletionTracker, seq: Sequence) -> None:
    assert seq.finish_reason is not None
    tracker.output.finish_reason = seq.finish_reason.value
    tracker.output.stop_reason = seq.stop_reason
