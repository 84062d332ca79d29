"""A conversation with tools, as the model's chat template takes it.

A template that knows tools (Qwen2.5's names ``tools`` and renders ``tool_calls`` itself)
gets them as Hugging Face templates expect: the tools' OpenAI objects, and each assistant
call's arguments as an object, not the JSON text OpenAI's messages carry. A template
that does not (SmolLM2's renders role and content only) gets a conversation tandem writes in
the same Hermes format: the tools in the system message, the assistant's calls as the text
the model would have written (router/tool_calls.py), the tools' answers as a user turn of
``<tool_response>`` blocks.
"""

import json
from typing import Any

from router.tool_calls import ARGS_END, Tool, call_prefix

ToolMessage = dict[str, Any]

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to answer the user. The functions' "
    "signatures are within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def knows_tools(template: Any) -> bool:
    """Whether the chat template renders tools itself (it names them)."""
    sources = template.values() if isinstance(template, dict) else [template]
    return any("tools" in str(source) for source in sources)


def call_arguments(messages: list[ToolMessage]) -> list[list[dict[str, Any]]]:
    """Each message's calls as (name, arguments object); ValueError names a call whose
    arguments are not a JSON object."""
    parsed = []
    for index, message in enumerate(messages):
        calls = []
        for number, call in enumerate(message.get("tool_calls") or []):
            function = call["function"]
            try:
                arguments = json.loads(function["arguments"] or "{}")
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ValueError(f"messages[{index}].tool_calls[{number}].function.arguments "
                                 "must be a JSON object's text")
            calls.append({"name": function["name"], "arguments": arguments})
        parsed.append(calls)
    return parsed


def for_tool_template(messages: list[ToolMessage]) -> list[ToolMessage]:
    """Messages for a template that renders calls itself: arguments as objects."""
    result = []
    for message, calls in zip(messages, call_arguments(messages), strict=True):
        message = dict(message)
        if calls:
            message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
            message["content"] = message.get("content") or ""
        result.append(message)
    return result


def for_plain_template(messages: list[ToolMessage], tools: list[Tool]) -> list[ToolMessage]:
    """Messages of role and text only, the tools and calls written out in Hermes' format."""
    result: list[ToolMessage] = []
    for message, calls in zip(messages, call_arguments(messages), strict=True):
        content = message.get("content") or ""
        if message["role"] == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if result and result[-1].get("tool_responses"):
                result[-1]["content"] += "\n" + response
            else:
                result.append({"role": "user", "content": response, "tool_responses": True})
            continue
        if calls:
            written = [call_prefix(call["name"]) + json.dumps(call["arguments"],
                                                              ensure_ascii=False) + ARGS_END
                       for call in calls]
            content = "\n".join(([content] if content else []) + written)
        result.append({"role": message["role"], "content": content})
    result = [{"role": m["role"], "content": m["content"]} for m in result]
    if tools:
        listed = "\n".join(json.dumps(tool.as_openai(), ensure_ascii=False) for tool in tools)
        prompt = TOOLS_PROMPT.format(tools=listed)
        if result and result[0]["role"] == "system":
            result[0]["content"] = f"{result[0]['content']}\n\n{prompt}"
        else:
            result.insert(0, {"role": "system", "content": prompt})
    return result
