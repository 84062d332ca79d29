"""What the engine hands back: per-request outputs and metrics."""

from dataclasses import dataclass, field


class RequestFailed(RuntimeError):
    """The engine failed one request (not the step, not the others): its message is written
    for the client and names no internals; the exception itself went to the engine's log."""


def part_ids(request_id: str, count: int) -> list[str]:
    """Ids for the ``count`` parts of one request: the engine's n samples of a prompt, the
    service's prompts of one completions request. One part keeps the request's own id."""
    return [request_id] if count == 1 else [f"{request_id}#{i}" for i in range(count)]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # set with the first token

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # per generated token: [(token_id, logprob), ...], the sampled token first, then the top-n
    logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = False
    error: str | None = None  # why the engine failed it (then finished, its completions aborted)

    # the first completion's fields, for the common n == 1 case
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class EngineStats:
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were found
    num_preemptions: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    spec_decode_num_drafts: int = 0  # verify steps of a sequence with drafts
    spec_decode_num_draft_tokens: int = 0  # drafts verified
    spec_decode_num_accepted_tokens: int = 0  # of which kept
    host_cache_hits: int = 0  # of the prefix-cache hits, prompt tokens found in the host tier
    disk_cache_hits: int = 0  # and in the disk tier
    kv_pulled_tokens: int = 0  # pulled from other replicas' host tiers into this one's
    kv_exported_tokens: int = 0  # read from this one's host tier for other replicas


@dataclass
class CompletionDelta:
    """What one completion gained in a step: the stream sends these, not whole outputs."""

    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestDelta:
    """One step's news of a request; the prompt rides only on the request's first delta."""

    request_id: str
    completions: list[CompletionDelta]
    metrics: RequestMetrics
    finished: bool
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    error: str | None = None  # the engine failed the request: its last delta says why


class OutputAccumulator:
    """Rebuilds the ``RequestOutput`` of a request from its stream of deltas.

    Copying whole token lists every step is the consumer's cost here, not the engine's.
    A delta that carries an error ends the stream: ``add`` raises it as ``RequestFailed``.
    """

    def __init__(self) -> None:
        self.output: RequestOutput | None = None

    def add(self, delta: RequestDelta) -> RequestOutput:
        if delta.error is not None:
            raise RequestFailed(delta.error)
        if self.output is None:
            assert delta.prompt_token_ids is not None, "the first delta carries the prompt"
            self.output = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids,
                                        [], delta.metrics)
        out = self.output
        by_index = {c.index: c for c in out.outputs}
        completions = []
        for d in delta.completions:
            old = by_index.get(d.index) or CompletionOutput(
                d.index, logprobs=[] if d.new_logprobs is not None else None)
            logprobs = old.logprobs
            if d.new_logprobs is not None:
                logprobs = (logprobs or []) + d.new_logprobs
            completions.append(CompletionOutput(
                d.index, old.token_ids + d.new_token_ids, old.text + d.new_text,
                d.finish_reason, d.stop_reason, logprobs))
        by_index.update((c.index, c) for c in completions)
        self.output = RequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                                    [by_index[i] for i in sorted(by_index)], delta.metrics,
                                    delta.finished)
        return self.output
