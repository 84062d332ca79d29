"""Tool calls in the Hermes format (Qwen2.5's, and the one tandem teaches models whose chat
template has none): the constraint that makes a model's calls well formed, and the parser
that reads them back out of its text.

A call is ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``; ``ARGS`` is
JSON matching the tool's ``parameters``. The grammar fixes every character around ``ARGS``
(no free whitespace), so the parser can cut ``ARGS`` out of the text as it grows: a
stream's argument deltas are exact slices of the text, and their concatenation is the
non-streamed ``arguments`` by construction.

``tool_choice``: "auto" lets the model write text and call when it wants (a call, once
begun, must be well formed); "required" and a named function make the whole output one
or more calls (one, with ``parallel_tool_calls`` false); "none" asks nothing of the output.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any

from router.structured_outputs import StructuredOutputs, schema_problems

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
ARGS_END = "}\n" + CALL_END  # what follows ARGS: the call object's brace, then the tag
SEPARATOR = "\n"  # between the calls of a "required" output
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (and dots, as vLLM)
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        """As a chat template takes it (OpenAI's ``{"type": "function", "function": ...}``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def check_tools(tools: list[Tool]) -> None:
    """Raises ValueError, naming the tool's field, for a name OpenAI would refuse, a name
    given twice, or a schema the grammar cannot enforce."""
    if not tools:
        raise ValueError("tools must hold at least one function")
    seen = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}].function"
        if not NAME.fullmatch(tool.name):
            raise ValueError(f"{where}.name {tool.name!r} must be 1 to 64 letters, digits, "
                             "underscores, dots or dashes")
        if tool.name in seen:
            raise ValueError(f"{where}.name {tool.name!r} is given twice")
        seen.add(tool.name)
        if not isinstance(tool.parameters, dict):
            raise ValueError(f"{where}.parameters must be a JSON schema object")
        for problem in schema_problems(tool.parameters):
            raise ValueError(f"{where}.parameters: {problem}")


def check_choice(tools: list[Tool], choice: str) -> None:
    """``choice``: "none", "auto", "required" or a function's name (the HTTP layer unwraps
    OpenAI's ``{"type": "function", "function": {"name": ...}}``)."""
    if choice in CHOICES:
        return
    if choice not in {tool.name for tool in tools}:
        raise ValueError(f"tool_choice names the function {choice!r}, which is not in tools "
                         f"(they are {', '.join(repr(t.name) for t in tools)})")


def call_prefix(name: str) -> str:
    return f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": '


def tool_call_constraint(tools: list[Tool], choice: str,
                         parallel: bool = True) -> StructuredOutputs | None:
    """The structural tag that enforces ``choice`` over ``tools``, or None for "none"."""
    check_tools(tools)
    check_choice(tools, choice)
    if choice == "none":
        return None
    chosen = tools if choice in CHOICES else [t for t in tools if t.name == choice]
    tags = [{"type": "tag", "begin": call_prefix(tool.name),
             "content": {"type": "json_schema", "json_schema": tool.parameters},
             "end": ARGS_END} for tool in chosen]
    if choice == "auto":
        layout: dict[str, Any] = {"type": "triggered_tags", "triggers": [CALL_BEGIN]}
    else:
        layout = {"type": "tags_with_separator", "separator": SEPARATOR, "at_least_one": True}
    layout.update(tags=tags, stop_after_first=not parallel)
    return StructuredOutputs(structural_tag={"type": "structural_tag", "format": layout})


# -- reading calls back out -------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, exactly as the model wrote it (partial while it streams)
    complete: bool


@dataclass(frozen=True)
class Parsed:
    """A text's content (outside the calls, stripped) and its calls, as far as they can be
    told apart. A partial parse holds back what later text could still change (a tail
    that may begin a call, a brace that may close one, trailing whitespace); each later
    parse of a longer text extends it: content and arguments only grow, names never change."""

    content: str
    calls: tuple[ParsedCall, ...]

    @property
    def called(self) -> bool:
        return any(call.complete for call in self.calls)


NAMED_CALL = re.compile(re.escape(CALL_BEGIN) + r'\n\{"name": ("(?:[^"\\]|\\.)*"), '
                        r'"arguments": ')


def parse_tool_calls(text: str, final: bool = True) -> Parsed:
    """The content and calls of ``text``. ``final``: the text is the whole output (nothing
    is held back; a call cut short keeps what it has, as OpenAI's do at ``length``)."""
    content, calls, position = [], [], 0
    while True:
        begin = text.find(CALL_BEGIN, position)
        if begin < 0:
            tail = text[position:]
            content.append(tail if final else tail[:len(tail) - held_prefix(tail, CALL_BEGIN)])
            break
        content.append(text[position:begin])
        named = NAMED_CALL.match(text, begin)
        if named is None:  # only a cut-off output ends inside a call's fixed opening
            if final:
                content.append(text[begin:])
            break
        name = json.loads(named.group(1))
        end = text.find(ARGS_END, named.end())
        if end < 0:
            arguments = text[named.end():]
            if not final:
                arguments = arguments[:len(arguments) - held_prefix(arguments, ARGS_END)]
            calls.append(ParsedCall(name, arguments, False))
            break
        calls.append(ParsedCall(name, text[named.end():end], True))
        position = end + len(ARGS_END)
    joined = "".join(content).lstrip()
    return Parsed(joined.rstrip() if final or calls else joined.rstrip(), tuple(calls))


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that begins ``marker``: characters that
    may yet turn out to be ``marker``'s, held back while the text grows."""
    for length in range(min(len(marker), len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
