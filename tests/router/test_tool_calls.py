"""The Hermes tool-call format: the structural tag each tool_choice compiles to, and the
parser that reads calls back, whole and as a stream grows (every prefix of an output parses
to a prefix of the final parse: content and arguments only grow, names never change)."""

import pytest

from router.structured_outputs import StructuredOutputs
from router.tool_calls import (
    ParsedCall,
    Tool,
    check_choice,
    check_tools,
    parse_tool_calls,
    tool_call_constraint,
)

WEATHER = Tool("get_weather", "The weather in a city.",
               {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]})
TIME = Tool("get_time")


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def tag(tool: Tool) -> dict:
    return {"type": "tag", "begin": f'<tool_call>\n{{"name": "{tool.name}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": tool.parameters},
            "end": "}\n</tool_call>"}


def test_auto_lets_text_through_and_triggers_on_the_call_tag():
    assert tool_call_constraint([WEATHER, TIME], "auto") == StructuredOutputs(structural_tag={
        "type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<tool_call>"],
            "tags": [tag(WEATHER), tag(TIME)], "stop_after_first": False}})


def test_required_and_named_make_the_whole_output_calls():
    required = tool_call_constraint([WEATHER, TIME], "required", parallel=False)
    assert required.structural_tag["format"] == {
        "type": "tags_with_separator", "separator": "\n", "at_least_one": True,
        "tags": [tag(WEATHER), tag(TIME)], "stop_after_first": True}
    named = tool_call_constraint([WEATHER, TIME], "get_time")
    assert named.structural_tag["format"]["tags"] == [tag(TIME)]
    assert tool_call_constraint([WEATHER], "none") is None


@pytest.mark.parametrize("tools, message", [
    ([], "tools must hold at least one function"),
    ([Tool("get weather")], "tools[0].function.name 'get weather' must be 1 to 64 letters, "
     "digits, underscores, dots or dashes"),
    ([TIME, TIME], "tools[1].function.name 'get_time' is given twice"),
    ([Tool("f", None, {"type": "array", "uniqueItems": True})],
     "tools[0].function.parameters: the JSON schema keyword 'uniqueItems' (at #) is not "
     "supported: tandem's grammar backend cannot enforce it, and an output breaking it would "
     "pass"),
])
def test_bad_tools_are_refused_naming_the_tool(tools, message):
    with pytest.raises(ValueError) as error:
        check_tools(tools)
    assert str(error.value) == message


def test_a_choice_naming_no_tool_is_refused():
    with pytest.raises(ValueError) as error:
        check_choice([WEATHER], "get_time")
    assert str(error.value) == ("tool_choice names the function 'get_time', which is not in "
                                "tools (they are 'get_weather')")


OUTPUTS = [
    "Paris is sunny.",
    call("get_weather", '{"city": "Paris"}'),
    call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", "{}"),
    "Let me look.\n" + call("get_weather", '{"city": "P\\"aris}"}') + "\nDone.",
    call("get_weather", '{"city": {"nested": {"x": [1, 2]}}}'),
    "a < b <tool but not a call",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
    '<tool_call>\n{"na',  # cut inside the call's opening
]


def test_whole_outputs_parse_to_content_and_calls():
    assert [parse_tool_calls(text) for text in OUTPUTS[:4]] == [
        parse("Paris is sunny."),
        parse("", ParsedCall("get_weather", '{"city": "Paris"}', True)),
        parse("", ParsedCall("get_weather", '{"city": "Paris"}', True),
              ParsedCall("get_time", "{}", True)),
        parse("Let me look.\n\nDone.", ParsedCall("get_weather", '{"city": "P\\"aris}"}', True)),
    ]
    assert parse_tool_calls(OUTPUTS[6]) == parse("", ParsedCall("get_weather", '{"city": "Par',
                                                                False))
    assert parse_tool_calls(OUTPUTS[7]) == parse('<tool_call>\n{"na')
    assert not parse_tool_calls(OUTPUTS[6]).called and parse_tool_calls(OUTPUTS[1]).called


def parse(content, *calls):
    from router.tool_calls import Parsed

    return Parsed(content, tuple(calls))


@pytest.mark.parametrize("text", OUTPUTS)
def test_every_prefix_parses_to_a_prefix_of_the_whole(text):
    whole = parse_tool_calls(text)
    previous = parse_tool_calls("", final=False)
    for end in range(len(text) + 1):
        partial = parse_tool_calls(text[:end], final=end == len(text))
        assert whole.content.startswith(partial.content)
        assert partial.content.startswith(previous.content)
        assert len(partial.calls) >= len(previous.calls)
        for index, now in enumerate(partial.calls):
            done = whole.calls[index]
            assert now.name == done.name and done.arguments.startswith(now.arguments)
            if index < len(previous.calls):
                assert now.arguments.startswith(previous.calls[index].arguments)
        previous = partial
    assert previous == whole
