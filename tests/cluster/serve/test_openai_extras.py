"""OpenAI fields vLLM clients send: echo and min_tokens, best_of and unknown response_format
types refused clearly, user and cache_salt accepted; over the fake cluster of test_protocol,
without Ray."""

import httpx2 as httpx

from cluster.serve.app import build_app
from cluster.serve.config import ServeConfig
from cluster.serve.openai_service import OpenAIService
from tests.cluster.serve.test_protocol import FakeCluster, events, run


class CharTokenizer:
    """One token per character: enough to tokenize, decode and echo."""

    eos_token_id = None

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, **_):
        return "".join(chr(i) for i in ids)


class RecordingCluster(FakeCluster):
    def __init__(self):
        super().__init__()
        self.params = []

    def generate(self, prompt_ids, params, request_id):
        self.params.append(params)
        return super().generate(prompt_ids, params, request_id)


def post(body, cluster=None, tokenizer=None):
    cluster = cluster or FakeCluster()

    async def go():
        settings = ServeConfig(model="fake", api_key=None, max_body_bytes=2048)
        app = build_app(OpenAIService(cluster, tokenizer, "fake"), settings)
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    return run(go())


def test_echo_puts_each_prompt_before_its_completion():
    response = post({"prompt": ["Hi ", "Yo "], "echo": True, "n": 2}, tokenizer=CharTokenizer())
    assert [c["text"] for c in response.json()["choices"]] == [
        "Hi Hello world", "Hi Hello world", "Yo Hello world", "Yo Hello world"]
    ids = post({"prompt": [72, 105], "echo": True}, tokenizer=CharTokenizer())
    assert ids.json()["choices"][0]["text"] == "HiHello world"  # token ids decoded


def test_echo_streams_the_prompt_first():
    response = post({"prompt": "Hi ", "echo": True, "stream": True}, tokenizer=CharTokenizer())
    chunks = events(response.text)
    texts = [c["choices"][0]["text"] for c in chunks[:-1] if c["choices"]]
    assert texts[0] == "Hi " and "".join(texts) == "Hi Hello world"


def test_echo_refusals():
    with_logprobs = post({"prompt": [1], "echo": True, "logprobs": 1})
    assert with_logprobs.status_code == 400
    assert with_logprobs.json()["error"]["message"] == (
        "echo with logprobs is not supported (no prompt logprobs)")
    no_tokenizer = post({"prompt": [1], "echo": True})
    assert no_tokenizer.status_code == 400
    assert no_tokenizer.json()["error"]["param"] == "echo"


def test_best_of_and_response_format_are_refused_clearly():
    best_of = post({"prompt": [1], "best_of": 3})
    assert best_of.status_code == 400 and best_of.json()["error"] == {
        "message": "best_of is not supported (got 3 with n = 1): leave it out or make it equal "
                   "to n", "type": "invalid_request_error", "param": "best_of",
        "code": "unsupported_value"}
    assert post({"prompt": [1], "best_of": 1}).status_code == 200
    json_format = post({"prompt": [1], "response_format": {"type": "json_xml"}})
    assert json_format.status_code == 400
    assert json_format.json()["error"]["message"] == (
        "response_format type 'json_xml' is not supported: use 'text', 'json_object' or "
        "'json_schema'")
    assert post({"prompt": [1], "response_format": {"type": "text"}}).status_code == 200


def test_user_and_cache_salt_are_accepted_and_the_salt_reaches_the_engine():
    cluster = RecordingCluster()
    response = post({"prompt": [1, 2], "user": "u-1", "cache_salt": "tenant-a"}, cluster)
    assert response.status_code == 200
    assert cluster.params[0].cache_salt == "tenant-a"
    assert post({"prompt": [1], "cache_salt": ""}).status_code == 400


def test_min_tokens_reaches_the_engine_and_is_checked_against_max_tokens():
    cluster = RecordingCluster()
    assert post({"prompt": [1], "min_tokens": 3, "max_tokens": 8}, cluster).status_code == 200
    assert (cluster.params[0].min_tokens, cluster.params[0].max_tokens) == (3, 8)
    too_many = post({"prompt": [1], "min_tokens": 9, "max_tokens": 8})
    assert too_many.status_code == 400
    assert too_many.json()["error"]["message"] == "min_tokens must be in [0, max_tokens=8], got 9"
