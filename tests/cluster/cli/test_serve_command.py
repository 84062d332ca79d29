"""`tandem serve` as a user runs it, with vLLM's flags: it comes up healthy and answers."""

import httpx2 as httpx
import pytest

from tests.cluster.cli.conftest import SERVED_MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_serve_with_the_brief_s_flags_comes_up_healthy(served_url):
    response = httpx.post(f"{served_url}/v1/completions", timeout=60, json={
        "model": SERVED_MODEL, "prompt": "The capital of France is",
        "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
