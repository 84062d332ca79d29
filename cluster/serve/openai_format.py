"""Engine outputs in OpenAI's shapes: choices, logprobs and usage."""

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from cluster.serve.tool_stream import assistant_message, finish_reason

# per generated token: [(sampled id, logprob), (top-1 id, logprob), ...]
TokenEntries = Sequence[list[tuple[int, float]]]


def token_text(tokenizer: PreTrainedTokenizerBase | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return str(tokenizer.decode([token_id]))


def completion_logprobs(tokenizer: PreTrainedTokenizerBase | None, entries: TokenEntries,
                        offset: int = 0) -> CompletionLogprobs:
    """``offset``: characters of text already sent before these tokens (for text_offset)."""
    result = CompletionLogprobs()
    for entry in entries:
        text = token_text(tokenizer, entry[0][0])
        result.tokens.append(text)
        result.token_logprobs.append(entry[0][1])
        result.top_logprobs.append({token_text(tokenizer, t): lp for t, lp in entry[1:]})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(tokenizer: PreTrainedTokenizerBase | None,
                  entries: TokenEntries) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for entry in entries:
        sampled = top(*entry[0])
        content.append(TokenLogprob(**sampled.model_dump(),
                                    top_logprobs=[top(t, lp) for t, lp in entry[1:]]))
    return ChatLogprobs(content=content)


def choice_index(prompt_index: int, n: int, completion: CompletionOutput) -> int:
    """Choices of prompt i are i*n .. i*n + n - 1, as OpenAI numbers them."""
    return prompt_index * n + completion.index


def completion_choices(tokenizer: PreTrainedTokenizerBase | None,
                       outputs: Sequence[RequestOutput], n: int,
                       echoes: Sequence[str] | None = None) -> list[CompletionChoice]:
    """``echoes``: each prompt's text, put before its choices' text."""
    return [
        CompletionChoice(
            index=choice_index(i, n, c), text=(echoes[i] if echoes else "") + c.text,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=None if c.logprobs is None else completion_logprobs(tokenizer, c.logprobs),
        )
        for i, output in enumerate(outputs) for c in output.outputs
    ]


def chat_choices(tokenizer: PreTrainedTokenizerBase | None, output: RequestOutput,
                 tool_calls: bool = False) -> list[ChatChoice]:
    """``tool_calls``: read each choice's text for calls (the request offered tools)."""
    choices = []
    for c in output.outputs:
        message, reason = AssistantMessage(content=c.text), c.finish_reason
        if tool_calls:
            message, parsed = assistant_message(c.text)
            reason = finish_reason(parsed, reason)
        choices.append(ChatChoice(
            index=c.index, message=message, finish_reason=reason, stop_reason=c.stop_reason,
            logprobs=None if c.logprobs is None else chat_logprobs(tokenizer, c.logprobs)))
    return choices


def usage(prompts: Sequence[Sequence[int]], outputs: Sequence[RequestOutput]) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
