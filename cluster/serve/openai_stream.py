"""Server-sent events: each snapshot from the engine becomes the text it adds since the last.

``CompletionOutput.text`` only grows (stop strings are held back until they can be ruled
out), so a delta is a plain slice and a stop string never leaks, even across chunks.
"""

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from cluster.engine.outputs import RequestOutput
from cluster.serve.failures import as_api_error
from cluster.serve.openai_format import chat_logprobs, choice_index, completion_logprobs
from cluster.serve.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
    now,
)
from cluster.serve.tool_stream import ToolCallStream, finish_reason

DONE = "data: [DONE]\n\n"
Stream = AsyncIterator[tuple[int, RequestOutput]]


def event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json(exclude_none=True)}\n\n"


@dataclass
class Delta:
    index: int  # the choice's index
    text: str
    logprobs: list[list[tuple[int, float]]] | None  # entries of the tokens since the last delta
    text_offset: int  # characters of this choice sent before
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class Cursor:
    text_sent: int = 0
    tokens_sent: int = 0
    done: bool = False


@dataclass
class DeltaTracker:
    """What each choice has been sent so far."""

    n: int
    token_chunks: bool = False  # a chunk per token even without text (no tokenizer)
    cursors: dict[int, Cursor] = field(default_factory=dict)

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        result = []
        for c in output.outputs:
            index = choice_index(prompt_index, self.n, c)
            cursor = self.cursors.setdefault(index, Cursor())
            text = c.text[cursor.text_sent:]
            new_tokens = self.token_chunks and len(c.token_ids) > cursor.tokens_sent
            if cursor.done or not (text or c.finished or new_tokens):
                continue
            entries = None if c.logprobs is None else c.logprobs[cursor.tokens_sent:]
            result.append(Delta(index, text, entries, cursor.text_sent, c.finish_reason,
                                c.stop_reason))
            cursor.text_sent, cursor.tokens_sent = len(c.text), len(c.token_ids)
            cursor.done = c.finished
        return result

    def usage(self, prompts: Sequence[Sequence[int]]) -> Usage:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(c.tokens_sent for c in self.cursors.values())
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


@dataclass
class StreamContext:
    request_id: str
    model: str
    tokenizer: PreTrainedTokenizerBase | None
    prompts: list[list[int]]
    n: int
    include_usage: bool
    continuous_usage: bool = False  # every chunk carries the usage so far
    created: int = field(default_factory=now)
    echoes: list[str] | None = None  # each prompt's text, sent first (completions' echo)
    tool_calls: bool = False  # chat: read the text for tool calls (tool_stream.py)


async def completion_events(stream: Stream, ctx: StreamContext) -> AsyncIterator[str]:
    def chunk(choices: list, usage: Usage | None = None) -> str:
        return event(CompletionResponse(id=ctx.request_id, model=ctx.model, created=ctx.created,
                                        choices=choices, usage=usage))

    def choice(d: Delta) -> CompletionChoice:
        logprobs = None if d.logprobs is None else completion_logprobs(
            ctx.tokenizer, d.logprobs, d.text_offset)
        return CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason,
                                stop_reason=d.stop_reason, logprobs=logprobs)

    for prompt_index, echo in enumerate(ctx.echoes or []):
        yield chunk([CompletionChoice(index=prompt_index * ctx.n + i, text=echo)
                     for i in range(ctx.n)])
    async for text in guarded(stream, choice_events(stream, ctx, chunk, choice)):
        yield text


async def chat_events(stream: Stream, ctx: StreamContext) -> AsyncIterator[str]:
    def chunk(choices: list, usage: Usage | None = None) -> str:
        return event(ChatCompletionChunk(id=ctx.request_id, model=ctx.model, created=ctx.created,
                                         choices=choices, usage=usage))

    calls: dict[int, ToolCallStream] = {}

    def choice(d: Delta) -> ChatChunkChoice:
        logprobs = None if d.logprobs is None else chat_logprobs(ctx.tokenizer, d.logprobs)
        delta, reason = DeltaMessage(content=d.text), d.finish_reason
        if ctx.tool_calls:
            reader = calls.setdefault(d.index, ToolCallStream())
            content, deltas = reader.feed(d.text, final=reason is not None)
            delta = DeltaMessage(content=content or None, tool_calls=deltas or None)
            reason = finish_reason(reader.parsed, reason)
        return ChatChunkChoice(index=d.index, delta=delta, finish_reason=reason,
                               stop_reason=d.stop_reason, logprobs=logprobs)

    # a chat stream opens with the assistant's role, one chunk for every choice
    opening = [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
               for i in range(ctx.n)]
    async for text in guarded(stream, choice_events(stream, ctx, chunk, choice, opening)):
        yield text


async def choice_events(
    stream: Stream, ctx: StreamContext, chunk: Callable[..., str],
    choice: Callable[[Delta], BaseModel], opening: list | None = None,
) -> AsyncIterator[str]:
    """One SSE chunk per engine output that adds something, then the usage chunk if asked."""
    tracker = DeltaTracker(ctx.n, token_chunks=ctx.tokenizer is None)

    def usage_so_far() -> Usage | None:
        return tracker.usage(ctx.prompts) if ctx.continuous_usage else None

    if opening:
        yield chunk(opening, usage_so_far())
    async for prompt_index, output in stream:
        choices = [choice(d) for d in tracker.deltas(prompt_index, output)]
        if choices:
            yield chunk(choices, usage_so_far())
    if ctx.include_usage:
        yield chunk([], tracker.usage(ctx.prompts))


async def guarded(stream: Stream, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Ends with [DONE]; an error mid-stream becomes an error event (a server failure's in
    our words, its exception in the log). A client that leaves cancels this generator, and
    closing ``stream`` aborts its requests."""
    async with aclosing(stream), aclosing(events):  # type: ignore[type-var]
        try:
            async for text in events:
                yield text
        except Exception as error:
            yield as_api_error(error).sse_event()
    yield DONE
