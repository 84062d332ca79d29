"""What each tool_choice's grammar lets a model write: "auto" any text and well-formed calls,
"required" and a named function only calls, one with parallel_tool_calls false; a call's
arguments compact JSON of its schema (as the stream's parser expects), a call to a function
nobody offered never."""

import pytest
from xgrammar.testing import _is_grammar_accept_string

from router.tool_calls import Tool, tool_call_constraint
from workers.structured.backend import to_grammar

WEATHER = Tool("get_weather", None, {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})
TIME = Tool("get_time")


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = call("get_weather", '{"city": "Paris", "days": 2}')
TIME_CALL = call("get_time", "{}")
OUTPUTS = {
    "text": "It is sunny in Paris.",
    "one call": PARIS,
    "two calls": PARIS + "\n" + TIME_CALL,
    "text then a call": "Let me look. " + PARIS,
    "loose whitespace": call("get_weather", '{ "city" : "Paris" }'),
    "a missing argument": call("get_weather", '{"days": 2}'),
    "a wrong type": call("get_weather", '{"city": 3}'),
    "an unknown function": call("get_news", "{}"),
}


@pytest.mark.parametrize("choice, parallel, accepted", [
    ("auto", True, {"text", "one call", "two calls", "text then a call"}),
    ("auto", False, {"text", "one call", "text then a call"}),
    ("required", True, {"one call", "two calls"}),
    ("required", False, {"one call"}),
    ("get_weather", True, {"one call"}),
])
def test_each_choice_accepts_exactly_its_outputs(choice, parallel, accepted):
    grammar = to_grammar(tool_call_constraint([WEATHER, TIME], choice, parallel))
    assert {name for name, text in OUTPUTS.items()
            if _is_grammar_accept_string(grammar, text)} == accepted
