"""Tool calls in a chat response: the parsed calls of a finished choice, and a choice's
calls as stream deltas. Both read the text with router/tool_calls.py's parser, so a
stream's argument deltas concatenate to the non-streamed arguments."""

import uuid
from dataclasses import dataclass, field

from cluster.serve.protocol import (
    AssistantMessage,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from router.tool_calls import Parsed, parse_tool_calls


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(parsed: Parsed, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for an output that ends (by the grammar's stop) after calls."""
    return "tool_calls" if reason == "stop" and parsed.called else reason


def assistant_message(text: str) -> tuple[AssistantMessage, Parsed]:
    parsed = parse_tool_calls(text)
    calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.calls]
    return AssistantMessage(content=parsed.content or None, tool_calls=calls or None), parsed


@dataclass
class ToolCallStream:
    """One choice's text so far, and what of its content and calls has been sent."""

    text: str = ""
    content_sent: int = 0
    calls_sent: list[tuple[str, int]] = field(default_factory=list)  # (id, argument chars)
    parsed: Parsed = field(default_factory=lambda: Parsed("", ()))

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and call deltas that ``text`` (the choice's next piece) adds."""
        self.text += text
        self.parsed = parse_tool_calls(self.text, final)
        content = self.parsed.content[self.content_sent:]
        self.content_sent = len(self.parsed.content)
        deltas = []
        for index, call in enumerate(self.parsed.calls):
            if index == len(self.calls_sent):
                self.calls_sent.append((call_id(), 0))
                deltas.append(DeltaToolCall(index=index, id=self.calls_sent[index][0],
                                            type="function", function=DeltaFunction(
                                                name=call.name, arguments=call.arguments)))
            elif len(call.arguments) > self.calls_sent[index][1]:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunction(
                    arguments=call.arguments[self.calls_sent[index][1]:])))
            self.calls_sent[index] = (self.calls_sent[index][0], len(call.arguments))
        return content, deltas
