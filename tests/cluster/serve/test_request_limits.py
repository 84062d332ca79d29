"""Bad input is refused at the edge with a 400 in OpenAI's shape, before any engine sees it:
seeds past 64 bits, strings that are not UTF-8, limits on max_tokens, n, stop strings and
floats, and fields tandem does not implement. Over the fake cluster of test_protocol."""

import json

import httpx2 as httpx
import pytest

from cluster.serve.app import build_app
from cluster.serve.config import ServeConfig
from cluster.serve.openai_service import OpenAIService
from tests.cluster.serve.test_openai_extras import CharTokenizer, RecordingCluster
from tests.cluster.serve.test_protocol import events, run

QUESTION = [{"role": "user", "content": "Hi"}]


class ChatTokenizer(CharTokenizer):
    """CharTokenizer with a chat template: each message's text on a line of its own."""

    chat_template = "lines"

    def apply_chat_template(self, messages, **_):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def encode(self, text, **_):
        return super().encode(text)


def call(method: str, path: str, body: object = None, raw: str | None = None,
         cluster: RecordingCluster | None = None) -> httpx.Response:
    """One request to the app; ``body`` is sent as ASCII JSON (escapes keep lone surrogates),
    ``raw`` as is (JSON's Infinity and NaN, which json.dumps would also write)."""
    content = raw if raw is not None else None if body is None else json.dumps(body)
    return calls([(method, path, content)], cluster)[0]


def calls(requests: list[tuple[str, str, str | None]],
          cluster: RecordingCluster | None = None) -> list[httpx.Response]:
    """Several requests, in order, to one app (one server: one start time on its model card)."""
    cluster = cluster or RecordingCluster()

    async def go():
        settings = ServeConfig(model="fake", api_key=None, max_body_bytes=1 << 16)
        app = build_app(OpenAIService(cluster, ChatTokenizer(), "fake"), settings)
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(method, path, content=content,
                                         headers={"Content-Type": "application/json"})
                    for method, path, content in requests]

    return run(go())


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def invalid(message: str, param: str | None, code: str) -> dict:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": code}


# -- seeds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_past_64_bits_is_refused(seed):
    cluster = RecordingCluster()
    response = call("POST", "/v1/completions", {"prompt": [1], "seed": seed}, cluster=cluster)
    error = error_of(response)
    assert error == invalid(f"seed must be a 64-bit integer, in [-2**63, 2**64), got {seed}",
                            "seed", "invalid_value")
    assert cluster.started == []  # refused before the cluster


def test_seeds_at_the_ends_of_the_range_reach_the_engine():
    cluster = RecordingCluster()
    for seed in (-(2**63), 2**64 - 1):
        response = call("POST", "/v1/completions", {"prompt": [1], "seed": seed, "n": 2},
                        cluster=cluster)
        assert response.status_code == 200, response.text
    assert [p.seed for p in cluster.params] == [-(2**63), 2**64 - 1]


# -- text -------------------------------------------------------------------------------------


SURROGATE = "x\ud800y"


@pytest.mark.parametrize("route, body, path", [
    ("completions", {"prompt": SURROGATE}, "prompt"),
    ("completions", {"prompt": ["fine", SURROGATE]}, "prompt[1]"),
    ("completions", {"prompt": [1], "stop": ["ok", SURROGATE]}, "stop[1]"),
    ("completions", {"prompt": [1], "user": SURROGATE}, "user"),
    ("completions", {"prompt": [1], "model": SURROGATE}, "model"),  # not a 404 that quotes it
    ("chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]},
     "messages[0].content"),
    ("chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": SURROGATE}]}]},
     "messages[0].content[1].text"),
])
def test_a_lone_surrogate_is_refused_naming_its_field(route, body, path):
    cluster = RecordingCluster()
    error = error_of(call("POST", f"/v1/{route}", body, cluster=cluster))
    assert error == invalid(f"{path} is not valid UTF-8 text: character 1 is a lone surrogate "
                            "('\\ud800'), which has no encoding", path.split("[")[0],
                            "invalid_text")
    assert cluster.started == []


def test_text_that_is_utf8_passes():
    response = call("POST", "/v1/completions", {"prompt": "h\u00e9llo \U0001f600",
                                                "stop": ["\u00e9"]})
    assert response.status_code == 200, response.text


# -- lengths and counts -----------------------------------------------------------------------


def test_max_tokens_beyond_the_context_left_is_refused_with_both_numbers():
    # the fake cluster's context is 64 tokens; the prompt takes 3
    error = error_of(call("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 62}))
    assert error == invalid("'max_tokens' is too large: 62. This model's maximum context length "
                            "is 64 tokens and your request has 3 input tokens (62 > 64 - 3).",
                            "max_tokens", "context_length_exceeded")
    assert call("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 61}).status_code \
        == 200
    huge = error_of(call("POST", "/v1/completions", {"prompt": [1], "max_tokens": 10**9}))
    assert huge["message"].startswith("'max_tokens' is too large: 1000000000.")


def test_chat_names_the_field_it_got_the_limit_from():
    # "user: Hi\nassistant: " is 20 characters, one token each
    for name in ("max_tokens", "max_completion_tokens"):
        error = error_of(call("POST", "/v1/chat/completions", {"messages": QUESTION, name: 45}))
        assert error == invalid(
            f"'{name}' is too large: 45. This model's maximum context length is 64 tokens and "
            "your request has 20 input tokens (45 > 64 - 20).", name, "context_length_exceeded")
    fits = call("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 44})
    assert fits.status_code == 200, fits.text


@pytest.mark.parametrize("extra, message, param", [
    ({"n": 129}, "n must be in [1, 128], got 129", "n"),
    ({"stop": [str(i) for i in range(33)]}, "stop may hold at most 32 strings, got 33", "stop"),
    ({"stop": "s" * 257}, "stop strings may be at most 256 characters long, got one of 257",
     "stop"),
])
def test_counts_and_lengths_are_bounded(extra, message, param):
    error = error_of(call("POST", "/v1/completions", {"prompt": [1], **extra}))
    assert error == invalid(message, param, "invalid_value")


@pytest.mark.parametrize("field, value, shown", [
    ("temperature", "Infinity", "inf"), ("temperature", "NaN", "nan"),
    ("top_p", "NaN", "nan"), ("min_p", "Infinity", "inf"),
    ("presence_penalty", "-Infinity", "-inf"), ("frequency_penalty", "NaN", "nan"),
    ("repetition_penalty", "Infinity", "inf"),
])
def test_floats_must_be_finite(field, value, shown):
    # Python's JSON parser accepts these non-standard literals, so they arrive as floats
    error = error_of(call("POST", "/v1/completions", raw=f'{{"prompt": [1], "{field}": {value}}}'))
    assert error == invalid(f"{field} must be a finite number, got {shown}", field,
                            "invalid_value")


# -- fields tandem does not implement ---------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("parallel_tool_calls", True),
    ("suffix", "!"),
    ("guided_whitespace_pattern", " *"),
    ("skip_special_tokens", False),
])
def test_each_unsupported_field_is_named(field, value):
    error = error_of(call("POST", "/v1/completions", {"prompt": [1], field: value}))
    assert error == invalid(f"Unsupported parameter: '{field}' is not supported by tandem.",
                            field, "unsupported_parameter")


def test_response_format_without_a_schema_is_named():
    error = error_of(call("POST", "/v1/chat/completions", {
        "messages": QUESTION, "response_format": {"type": "json_schema"}}))
    assert error == invalid("response_format of type 'json_schema' needs a json_schema object "
                            "with the schema in its 'schema' field", "response_format",
                            "invalid_value")
    other = error_of(call("POST", "/v1/chat/completions", {
        "messages": QUESTION, "response_format": {"type": "xml"}}))
    assert other == invalid("response_format type 'xml' is not supported: use 'text', "
                            "'json_object' or 'json_schema'", "response_format",
                            "unsupported_value")


def test_unknown_and_nested_fields_are_named():
    unknown = error_of(call("POST", "/v1/completions", {"prompt": [1], "max_token": 5}))
    assert unknown == invalid("Unknown parameter: 'max_token'.", "max_token", "unknown_parameter")
    several = error_of(call("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi", "name": "ann"}],
        "functions": [{"name": "f"}], "colour": "red",
        "stream_options": {"include_usage": True, "every_chunk": True}}))
    assert several == invalid(
        "Unsupported parameters: 'functions', 'messages[0].name' are not supported by tandem; "
        "unknown parameters: 'colour', 'stream_options.every_chunk'.", "functions",
        "unsupported_parameter")


def test_fields_that_ask_for_nothing_are_accepted():
    body = {"prompt": [1], "tools": None, "logit_bias": {}, "functions": [], "suffix": "",
            "tool_choice": "none", "skip_special_tokens": True, "stop": None,
            "include_stop_str_in_output": False}
    assert call("POST", "/v1/completions", body).status_code == 200
    chat = call("POST", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": "Yo", "tool_calls": [], "refusal": None},
        {"role": "user", "content": "?"}]})
    assert chat.status_code == 200, chat.text


def test_guidellm_and_bench_serve_bodies_are_accepted():
    """The bodies guidellm 0.8 (its openai_http backend) and `tandem bench serve` send."""
    limits = {"stop": None, "ignore_eos": True}
    options = {"stream": True, "stream_options": {"include_usage": True,
                                                  "continuous_usage_stats": True}}
    chat = call("POST", "/v1/chat/completions", {
        "model": "fake", **options, "max_completion_tokens": 8, **limits,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    completion = call("POST", "/v1/completions", {
        "model": "fake", **options, "max_tokens": 8, **limits, "prompt": "Hi"})
    bench = call("POST", "/v1/completions", {
        "model": "fake", "prompt": [1, 2], "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    for response in (chat, completion, bench):
        assert response.status_code == 200, response.text
        assert events(response.text)[-1] == "[DONE]"
    # continuous_usage_stats: every chunk carries the usage so far, the last one all of it
    chunks = events(completion.text)[:-1]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5, 5]
    assert all("usage" not in c for c in events(bench.text)[:-2])


# -- models -----------------------------------------------------------------------------------


def test_a_model_is_found_by_its_id():
    # one server: its two answers were taken from two servers started a second apart
    listing, one = calls([("GET", "/v1/models", None), ("GET", "/v1/models/fake", None)])
    listed = listing.json()["data"]
    assert one.status_code == 200 and [one.json()] == listed
    assert one.json()["object"] == "model" and one.json()["max_model_len"] == 64


@pytest.mark.parametrize("name", ["gpt-4", "org/other-model"])
def test_an_unknown_model_id_is_404(name):
    error = error_of(call("GET", f"/v1/models/{name}"), 404)
    assert error == invalid(f"The model `{name}` does not exist.", "model", "model_not_found")


# -- every error names its problem in `code` ---------------------------------------------------


def test_an_empty_messages_list_is_named():
    cluster = RecordingCluster()
    error = error_of(call("POST", "/v1/chat/completions", {"messages": []}, cluster=cluster))
    assert error == invalid("messages must not be empty: send at least one message",
                            "messages", "empty_messages")
    assert cluster.started == []


def test_a_body_that_is_not_utf8_is_named_not_a_parse_error():
    # FastAPI's own answer was "There was an error parsing the body", code null
    body = b'{"prompt": "caf\xe9"}'  # Latin-1, not UTF-8
    error = error_of(call("POST", "/v1/completions", raw=body))
    assert error == invalid("The request body is not valid UTF-8: byte 0xe9 at position 15 "
                            "(invalid continuation byte).", None, "invalid_utf8")


@pytest.mark.parametrize("method, path, body, status, expected", [
    ("POST", "/v1/completions", "{not json", 400,
     invalid("The request body is not valid JSON: Expecting property name enclosed in double "
             "quotes (at character 1).", None, "invalid_json")),
    ("POST", "/v1/completions", "", 400,
     invalid("The request body is empty: send a JSON object.", None, "missing_body")),
    ("POST", "/v1/completions", {"max_tokens": 4}, 400,
     invalid("prompt: Field required", "prompt", "missing_required_parameter")),
    ("POST", "/v1/completions", {"prompt": [1], "temperature": "hot"}, 400,
     invalid("temperature: Input should be a valid number, unable to parse string as a number",
             "temperature", "invalid_type")),
    ("POST", "/v1/completions", {"prompt": []}, 400,
     invalid("prompt must not be empty: send at least one prompt", "prompt", "empty_prompt")),
    ("POST", "/v1/completions", {"prompt": [[1], []]}, 400,
     invalid("prompt is empty: a prompt must have at least one token", "prompt",
             "empty_prompt")),
    ("POST", "/v1/completions", {"prompt": [1], "top_p": 1.5}, 400,
     invalid("top_p must be in (0, 1], got 1.5", "top_p", "invalid_value")),
    ("POST", "/v1/completions", {"prompt": [1], "echo": True, "logprobs": 1}, 400,
     invalid("echo with logprobs is not supported (no prompt logprobs)", "echo",
             "unsupported_value")),
    ("POST", "/v1/completions", {"prompt": [1], "model": "gpt-4"}, 404,
     invalid("The model `gpt-4` does not exist.", "model", "model_not_found")),
    ("POST", "/v1/embeddings", {"input": "hi"}, 404,
     {"message": "Invalid URL (POST /v1/embeddings): no such route.", "type": "not_found_error",
      "param": None, "code": "unknown_url"}),
    ("PUT", "/v1/completions", {"prompt": [1]}, 405,
     invalid("Method PUT is not allowed for /v1/completions (allowed: POST).", None,
             "method_not_allowed")),
])
def test_every_refusal_has_a_code_that_names_it(method, path, body, status, expected):
    raw = body if isinstance(body, str) else None
    response = call(method, path, None if raw is not None else body, raw=raw)
    assert error_of(response, status) == expected
    if status == 405:
        assert response.headers["allow"] == "POST"
