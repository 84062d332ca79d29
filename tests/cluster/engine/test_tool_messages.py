"""A conversation with tools through the default model's tokenizer: its template renders role
and content only, so tandem writes the tools, the assistant's calls and the tools' answers in
Hermes' format; a template that knows tools (Qwen2.5's kind) gets them, and each call's
arguments as an object, from the template itself."""

import json

import pytest

from cluster.engine.tokenizer import apply_chat_template, load_tokenizer
from cluster.engine.tool_messages import TOOLS_PROMPT
from router.tool_calls import Tool

WEATHER = Tool("get_weather", "The weather in a city.",
               {"type": "object", "properties": {"city": {"type": "string"}}})
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
]
# Qwen2.5's way, shortened: tools in the system turn, calls rendered from their objects
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0].content }}\n<tools>{% for t in tools %}"
    "\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}<|im_start|>assistant{% for c in m.tool_calls %}"
    "\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif not (tools and m.role == 'system') %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    return load_tokenizer(tiny_chat_model)


def prompt(tokenizer, messages, tools=None) -> str:
    return tokenizer.decode(apply_chat_template(tokenizer, messages, tools))


def test_a_plain_template_gets_tools_calls_and_answers_written_out(tokenizer):
    tools = json.dumps(WEATHER.as_openai())
    system = "Be brief.\n\n" + TOOLS_PROMPT.format(tools=tools)
    assert prompt(tokenizer, CONVERSATION, [WEATHER]) == (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_without_tools_offered_the_calls_are_still_written_and_no_tools_prompt(tokenizer):
    text = prompt(tokenizer, CONVERSATION[1:])
    assert "<tools>" not in text and text.count("<tool_call>") == 2
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_a_template_that_knows_tools_renders_them_itself(tokenizer):
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)  # a copy to change
    tokenizer.chat_template = TOOL_TEMPLATE
    text = prompt(tokenizer, CONVERSATION[:3], [WEATHER])
    assert json.dumps(WEATHER.as_openai()) in text  # the template's own tojson of the tool
    assert text.count('"arguments": {"city": ') == 2 and '"arguments": "' not in text


def test_arguments_that_are_not_an_object_are_refused_by_message():
    bad = [CONVERSATION[1], {**CONVERSATION[2], "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]

    class Template:
        chat_template = "plain"

    with pytest.raises(ValueError) as error:
        apply_chat_template(Template(), bad)  # type: ignore[arg-type]
    assert str(error.value) == ("messages[1].tool_calls[0].function.arguments must be a JSON "
                                "object's text")
