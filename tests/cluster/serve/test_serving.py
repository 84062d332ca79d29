"""The HTTP API end to end: the official `openai` client against the default model on Ray Serve.

One Ray instance and one Serve instance for the module, on a port found at run time; one
application that needs an API key, two HTTP replicas in front of one engine replica (an
application and its engine cost ~10 s of the suite's start: one serves every test here).
"""

import json
import socket
import threading
import time

import httpx2 as httpx
import jsonschema
import openai
import pydantic
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from cluster.ray.start import init_ray
from cluster.serve.app import server_app
from cluster.serve.config import ServeConfig
from cluster.serve.prometheus import METRIC_NAMES
from tests.metrics_scrape import scrape

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-test-key"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
APP = "keyed"
PROMPT = "Once upon a time"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    started_ray = not ray.is_initialized()
    if started_ray:
        init_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = dict(model=MODEL, device="cpu", dtype="float32", num_kv_blocks=96,
                  max_model_len=512, max_body_bytes=64 << 10)
    serve.run(server_app(ServeConfig(**common, api_key=API_KEY, ingress_replicas=2)),
              name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    if started_ray:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)


def greedy(**extra):
    return dict(model=MODEL, temperature=0.0, **extra)


def test_completion_and_usage(client):
    out = client.completions.create(prompt=PROMPT, max_tokens=12, **greedy())
    assert out.model == MODEL and len(out.choices) == 1
    assert out.choices[0].text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0


def test_chat_uses_the_template(client):
    out = client.chat.completions.create(messages=QUESTION, max_tokens=16, **greedy())
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_text_equals_greedy_text(client):
    full = client.chat.completions.create(messages=QUESTION, max_tokens=24, **greedy())
    chunks = list(client.chat.completions.create(
        messages=QUESTION, max_tokens=24, stream=True,
        stream_options={"include_usage": True}, **greedy()))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    plain = client.completions.create(prompt=PROMPT, max_tokens=16, **greedy())
    streamed = client.completions.create(prompt=PROMPT, max_tokens=16, stream=True, **greedy())
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


def test_n_choices_and_several_prompts(client):
    out = client.completions.create(prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=5,
                                    model=MODEL)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 24
    two = client.completions.create(prompt=[PROMPT, "The sky is"], n=2, max_tokens=4,
                                    **greedy())
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(messages=QUESTION, n=2, max_tokens=6, **greedy())
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_string_never_leaks(client):
    text = client.completions.create(prompt=PROMPT, max_tokens=24, **greedy()).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 5]  # likely spans two tokens
    out = client.completions.create(prompt=PROMPT, max_tokens=24, stop=[stop], **greedy())
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(prompt=PROMPT, max_tokens=24, stop=stop, stream=True,
                                       **greedy())
    assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop)]


def test_logprobs(client):
    out = client.completions.create(prompt=PROMPT, max_tokens=5, logprobs=3, **greedy())
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()))
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(messages=QUESTION, max_tokens=4, logprobs=True,
                                          top_logprobs=2, **greedy())
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base_url}/health").status_code == 200


@pytest.mark.parametrize("route, body, status, param", [
    ("completions", "{not json", 400, None),
    ("completions", {"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": PROMPT, "n": 0}, 400, "n"),
    ("completions", {"prompt": PROMPT, "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("completions", {"prompt": [10**9]}, 400, "prompt"),
    ("completions", {"prompt": "word " * 600}, 400, "prompt"),  # past max_model_len 512
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("chat/completions", {"messages": QUESTION, "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x" * (70 << 10)}, 413, None),
])
def test_bad_requests_get_openai_errors(base_url, route, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{base_url}/v1/{route}", content=content, headers=HEADERS)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"], error
    if param is not None:
        assert error["param"] == param, error


def test_a_bad_seed_or_a_lone_surrogate_is_a_400_while_others_stream_on(client, base_url):
    """A seed past 64 bits used to crash the shard, failing every request of its replica, and
    a lone surrogate was a 500 from the tokenizer: now each is a 400 while the streams beside
    it run on to a clean run's text. The n samples of seed 2**64 - 1 (seeds past it wrap)
    reach the engine and are answered."""
    from concurrent.futures import ThreadPoolExecutor

    settings = dict(prompt=PROMPT, max_tokens=48, extra_body={"ignore_eos": True}, **greedy())
    expected = client.completions.create(**settings).choices[0].text
    started = threading.Barrier(5)

    def stream_text() -> str:
        chunks = iter(client.completions.create(stream=True, **settings))
        text = next(chunks).choices[0].text
        started.wait(timeout=60)  # every stream is under way before the bad requests come
        return text + "".join(c.choices[0].text for c in chunks)

    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{base_url}/v1/{route}", content=json.dumps(body), timeout=60,
                          headers=HEADERS)

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_text) for _ in range(4)]
        started.wait(timeout=60)
        seed = post("completions", {"prompt": PROMPT, "seed": 2**64, "max_tokens": 4})
        chat = post("chat/completions", {"messages": [{"role": "user", "content": "x\ud800y"}]})
        text = post("completions", {"prompt": "x\ud800y", "max_tokens": 4})
        wrapped = client.completions.create(prompt=PROMPT, n=2, seed=2**64 - 1, max_tokens=4,
                                            temperature=1.0, model=MODEL)
        texts = [s.result(timeout=120) for s in streams]
    assert texts == [expected] * 4
    assert seed.status_code == 400 and seed.json()["error"] == {
        "message": "seed must be a 64-bit integer, in [-2**63, 2**64), got 18446744073709551616",
        "type": "invalid_request_error", "param": "seed", "code": "invalid_value"}
    surrogate = ("is not valid UTF-8 text: character 1 is a lone surrogate ('\\ud800'), which "
                 "has no encoding")
    assert chat.status_code == 400
    assert chat.json()["error"]["message"] == f"messages[0].content {surrogate}"
    assert text.status_code == 400 and text.json()["error"]["message"] == f"prompt {surrogate}"
    assert [c.index for c in wrapped.choices] == [0, 1]
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_disconnect_mid_stream_aborts_and_frees_blocks(client, base_url):
    before = scrape(base_url)
    aborted = "tandem:request_success_total{finished_reason=abort}"
    # the longest answer the model's length allows (512): the disconnect after three chunks
    # must reach it before it ends by itself, on a busy machine too (200 tokens did not always)
    longest = 500
    stream = client.completions.create(prompt=PROMPT, max_tokens=longest,
                                       stream=True, extra_body={"ignore_eos": True}, **greedy())
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    deadline = time.monotonic() + 120  # generous: the abort reaches the engine in its own time
    while time.monotonic() < deadline:
        after = scrape(base_url)
        if (after["tandem:kv_cache_blocks_used{}"] == 0
                and after["tandem:num_requests_running{}"] == 0
                and after[aborted] > before[aborted]):
            break
        time.sleep(0.2)
    assert after["tandem:kv_cache_blocks_used{}"] == 0
    assert after[aborted] == before[aborted] + 1
    generated = "tandem:generation_tokens_total{}"
    assert after[generated] < before[generated] + longest


def test_api_key_is_enforced(base_url):
    url = f"{base_url}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert httpx.post(f"{url}/completions", json={"prompt": PROMPT}).status_code == 401
    keyed = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)
    assert keyed.completions.create(prompt=PROMPT, max_tokens=2, **greedy()).choices
    assert httpx.get(f"{base_url}/health").status_code == 200  # health needs no key


def test_metrics_are_all_exposed(client, base_url):
    client.completions.create(prompt=PROMPT, max_tokens=4, **greedy())
    text = httpx.get(f"{base_url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name for f in families.values() for s in f.samples}
    for name in METRIC_NAMES:
        assert name in families or name in samples, name
    values = scrape(base_url)
    assert values["tandem:time_to_first_token_seconds_count{}"] >= 1
    assert values["tandem:generation_tokens_total{}"] >= 4
    assert values["tandem:kv_cache_blocks_total{}"] == 96
    assert {s.labels["model_name"] for s in families["tandem:batch_size"].samples} == {MODEL}


def test_ingress_replicas_share_one_set_of_engines(client, base_url):
    from concurrent.futures import ThreadPoolExecutor

    status = serve.status().applications[APP].deployments
    assert status["tandem"].replica_states.get("RUNNING") == 2
    assert status["tandem-engines"].replica_states.get("RUNNING") == 1
    def generated_by_replica() -> list[tuple[str, float]]:
        text = httpx.get(f"{base_url}/metrics").text
        return [(s.labels["replica"], s.value) for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "tandem:generation_tokens_total"]

    [(_, before)] = generated_by_replica()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: client.completions.create(
            prompt=PROMPT, max_tokens=6, **greedy()).choices[0].text, range(8)))
    expected = client.completions.create(prompt=PROMPT, max_tokens=6, **greedy()).choices[0].text
    assert outs == [expected] * 8
    # whichever HTTP replica answers, /metrics reports the one engine, which ran all 9 (were
    # there an engine per HTTP replica, the requests would split between them)
    for _ in range(4):
        assert generated_by_replica() == [("0", before + 9 * 6)]


# -- structured outputs and tools through the official client (docs/structured-outputs.md) --


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def test_parse_returns_the_pydantic_object_the_schema_asked_for(client):
    out = client.chat.completions.parse(
        messages=[{"role": "user", "content": "Name a city in France."}], response_format=City,
        max_tokens=60, **greedy())
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


SCHEMAS = [
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3},
        "score": {"type": "integer", "minimum": 0, "maximum": 10}},
     "required": ["tags", "score"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"],
        "additionalProperties": False}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                      "label": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
     "required": ["start", "label"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum-array-bounds", "ref-pattern"])
def test_a_json_schema_is_answered_with_valid_json(client, schema):
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "Describe a small red shape as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        max_tokens=80, **greedy())
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def tool_arguments(chunks) -> list[str]:  # type: ignore[no-untyped-def]
    """Each streamed call's arguments, their deltas joined, by the call's index."""
    arguments: dict[int, str] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments
                                                                     or "")
    return [arguments[index] for index in sorted(arguments)]


def test_a_tool_call_streamed_its_result_sent_back_and_the_answer(client):
    out = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, **greedy())
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # streamed, the function named: the argument deltas add up to the whole's
    named = {"type": "function", "function": {"name": "get_weather"}}
    one = dict(tools=TOOLS, tool_choice=named, parallel_tool_calls=False, max_tokens=120)
    whole = client.chat.completions.create(messages=ASK, **one, **greedy())
    chunks = list(client.chat.completions.create(messages=ASK, **one, stream=True, **greedy()))
    assert tool_arguments(chunks) == [c.function.arguments
                                      for c in whole.choices[0].message.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the tool's result goes back in the conversation; with tool_choice none, a plain answer
    conversation = ASK + [
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(messages=conversation, tools=TOOLS,
                                            tool_choice="none", max_tokens=40, **greedy())
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # auto: whatever the model chooses comes back in OpenAI's form
    auto = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="auto",
                                          parallel_tool_calls=False, max_tokens=120,
                                          **greedy()).choices[0]
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(auto.message.tool_calls[0].function.arguments), WEATHER)
    else:
        assert auto.message.content and auto.finish_reason in ("stop", "length")
