"""A schema-driven fuzz of the published OpenAPI document (schemathesis): valid and invalid
bodies for every route, and not one 5xx, nor a traceback in any body, nor an error without a
code. The app runs in-process over a fake cluster that checks prompts as the engine does
(token ids in its vocabulary)."""

import asyncio
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from cluster.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cluster.serve.app import build_app
from cluster.serve.config import ServeConfig
from cluster.serve.openai_service import OpenAIService
from tests.cluster.serve.test_protocol import FakeCluster
from tests.cluster.serve.test_request_limits import ChatTokenizer

VOCAB = 1000


class CheckingCluster(FakeCluster):
    """Refuses token ids outside the vocabulary, as the engine's check_prompt does; answers
    every request with one short completion per sample."""

    max_model_len = 256

    async def generate(self, prompt_ids, params, request_id):
        bad = [t for t in prompt_ids if not 0 <= t < VOCAB]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {VOCAB}")
        await asyncio.sleep(0)
        logprobs = None if params.logprobs is None else [[(72, -0.5)] * (1 + params.logprobs)]
        outputs = [CompletionOutput(i, [72], "H", "length", None, logprobs)
                   for i in range(params.n)]
        yield RequestOutput(request_id, None, prompt_ids, outputs, RequestMetrics(0.0), True)


app = build_app(OpenAIService(CheckingCluster(), ChatTokenizer(), "fake"),
                ServeConfig(model="fake", api_key=None, max_body_bytes=1 << 16))
# schemathesis keeps a cache of responses in .schemathesis/ under the directory it runs in (the
# checkout) unless told otherwise: off, and pointed at the temp dir should it ever be used
STATE = Path(tempfile.gettempdir()) / "tandem-schemathesis"
CONFIG = SchemathesisConfig.from_dict({"cache": {"enabled": False, "directory": str(STATE)}})
schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)
CHECKOUT = Path(__file__).resolve().parents[3]


def test_schemathesis_keeps_no_state_in_the_checkout():
    cache = schema.config.cache
    assert (cache.enabled, cache.directory) == (False, STATE)
    assert not STATE.resolve().is_relative_to(CHECKOUT)
    # and should a run leave one all the same, git does not offer it
    assert ".schemathesis/" in (CHECKOUT / ".gitignore").read_text().splitlines()


@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_5xx_or_a_traceback(case):
    response = case.call()
    assert response.status_code < 500, (case.body, response.text)
    assert "Traceback" not in response.text and 'File "' not in response.text, response.text
    if response.status_code >= 400:  # OpenAI's error body, with a code that names the problem
        error = response.json()["error"]
        assert error["code"] and error["message"], response.text
