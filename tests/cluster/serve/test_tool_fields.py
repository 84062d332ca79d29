"""Tools over HTTP, through a scripted fake cluster: the constraint each tool_choice sends to
the engine, the calls read back into message.tool_calls with OpenAI's finish reason, a stream's
deltas that add up to the same calls whatever the chunking, and a 400 naming the field for
each thing a client can get wrong."""

import json

import pytest

from cluster.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from router.tool_calls import Tool, tool_call_constraint
from tests.cluster.serve.test_protocol import events
from tests.cluster.serve.test_request_limits import QUESTION, call, error_of, invalid

WEATHER_SPEC = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME_SPEC = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER_SPEC, TIME_SPEC]
WEATHER = Tool("get_weather", "The weather in a city.", WEATHER_SPEC["function"]["parameters"])
TIME = Tool("get_time")


def tool_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


TWO_CALLS = (tool_call("get_weather", '{"city": "Paris \\"Ville\\""}') + "\n"
             + tool_call("get_time", "{}"))


class ScriptedCluster:
    """Releases ``text`` ``step`` characters at a time, then finishes with ``reason``."""

    max_model_len = 4096

    def __init__(self, text: str, step: int = 1, reason: str = "stop") -> None:
        self.text, self.step, self.reason = text, step, reason
        self.params, self.prompts, self.started = [], [], []

    async def generate(self, prompt_ids, params, request_id):
        self.params.append(params)
        self.prompts.append("".join(chr(i) for i in prompt_ids))
        self.started.append(request_id)
        ends = list(range(self.step, len(self.text), self.step)) + [len(self.text)]
        for end in ends:
            done = end == len(self.text)
            yield RequestOutput(request_id, None, prompt_ids, [CompletionOutput(
                0, list(range(end)), self.text[:end], self.reason if done else None)],
                RequestMetrics(0.0), finished=done)


def chat(body: dict, cluster: ScriptedCluster):
    return call("POST", "/v1/chat/completions", {"messages": QUESTION, **body}, cluster=cluster)


@pytest.mark.parametrize("fields, choice, parallel", [
    ({}, "auto", True),
    ({"tool_choice": "required", "parallel_tool_calls": False}, "required", False),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "get_time", True),
])
def test_each_tool_choice_sends_its_constraint(fields, choice, parallel):
    cluster = ScriptedCluster("hi")
    assert chat({"tools": TOOLS, **fields}, cluster).status_code == 200
    assert cluster.params[0].structured_outputs == tool_call_constraint(
        [WEATHER, TIME], choice, parallel)


def test_tool_choice_none_offers_nothing_and_reads_no_calls():
    cluster = ScriptedCluster(TWO_CALLS)
    body = chat({"tools": TOOLS, "tool_choice": "none"}, cluster).json()
    assert cluster.params[0].structured_outputs is None
    assert "get_weather" not in cluster.prompts[0]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TWO_CALLS,
                                             "tool_calls": None}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_calls_come_back_as_tool_calls_with_their_finish_reason():
    cluster = ScriptedCluster(TWO_CALLS)
    choice = chat({"tools": TOOLS}, cluster).json()["choices"][0]
    assert "get_weather" in cluster.prompts[0]  # the tools are in the prompt
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris \\"Ville\\""}'}),
        ("function", {"name": "get_time", "arguments": "{}"})]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Paris "Ville"'}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "tool_calls"


def test_text_without_calls_is_content_and_stops():
    choice = chat({"tools": TOOLS}, ScriptedCluster(" It is sunny. ")).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny.",
                                 "tool_calls": None}
    assert choice["finish_reason"] == "stop"


def test_a_call_cut_short_keeps_its_arguments_so_far_and_finishes_by_length():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    choice = chat({"tools": TOOLS}, ScriptedCluster(text, reason="length")).json()["choices"][0]
    assert choice["message"]["content"] == "Sure."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                              "arguments": '{"ci'}
    assert choice["finish_reason"] == "length"


def streamed(text: str, step: int) -> tuple[str, list[dict], str]:
    """A stream's content, calls (id, name and the arguments' concatenation) and finish."""
    chunks = events(chat({"tools": TOOLS, "stream": True}, ScriptedCluster(text, step)).text)
    assert chunks[-1] == "[DONE]"
    content, calls, finish = "", [], None
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            if part["index"] == len(calls):
                assert set(part) == {"index", "id", "type", "function"}
                calls.append({"id": part["id"], **part["function"]})
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {
                    "arguments"}
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
        finish = choice.get("finish_reason") or finish
    return content, calls, finish


@pytest.mark.parametrize("text", [TWO_CALLS, "Let me check.\n" + tool_call(
    "get_weather", '{"city": "Rome"}') + "\nOne moment.", "No calls <tool at all."])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_stream_adds_up_to_the_whole_response(text, step):
    whole = chat({"tools": TOOLS}, ScriptedCluster(text)).json()["choices"][0]
    content, calls, finish = streamed(text, step)
    assert content == (whole["message"]["content"] or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"])
        for c in whole["message"]["tool_calls"] or []]
    assert len({c["id"] for c in calls}) == len(calls)
    assert finish == whole["finish_reason"]


@pytest.mark.parametrize("body, message, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope', which is not in tools (they are 'get_weather', "
     "'get_time')", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools, and the request has "
     "none", "tool_choice"),
    ({"tools": [TIME_SPEC, TIME_SPEC]}, "tools[1].function.name 'get_time' is given twice",
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name 'a b' must be 1 to 64 letters, digits, underscores, dots or "
     "dashes", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}]},
     "tools does not compile: ", "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}},
     "conflicting constraints: tools (with tool_choice 'auto') and response_format both "
     "constrain the output; send tool_choice 'none' or leave one out", "response_format"),
    ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments must be a JSON object's text", "messages"),
])
def test_tool_refusals_name_the_field_and_reach_no_cluster(body, message, param):
    cluster = ScriptedCluster("hi")
    error = error_of(chat(body, cluster))
    assert error["message"].startswith(message) and error["param"] == param, error
    assert cluster.started == []


def test_tools_on_completions_are_refused_as_unsupported():
    error = error_of(call("POST", "/v1/completions", {"prompt": [1], "tools": TOOLS}))
    assert error == invalid("Unsupported parameter: 'tools' is not supported by tandem.",
                            "tools", "unsupported_parameter")
