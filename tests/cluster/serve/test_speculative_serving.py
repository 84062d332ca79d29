"""An EAGLE head behind the OpenAI API, through the official `openai` client: the same greedy
chat answer, streamed and not, as the engine without speculation gives, with the head's
drafts verified on the way. In process: the OpenAI app over one engine (no Ray, no Serve)."""

import asyncio

import httpx
import openai

from cluster import LLM, SamplingParams
from cluster.serve.app import build_app
from cluster.serve.config import ServeConfig
from cluster.serve.openai_service import OpenAIService
from tests.eagle_heads import write_head

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 16


class EngineCluster:
    """One in-process engine as the OpenAI service's cluster: a request is stepped to its end
    (one at a time: enough for a test)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.max_model_len = llm.engine.max_model_len

    async def generate(self, prompt_ids, params, request_id):  # type: ignore[no-untyped-def]
        engine = self.llm.engine
        engine.add_request(prompt_ids, params, request_id)
        while True:
            for output in engine.step():
                if output.request_id == request_id:
                    yield output
                    if output.finished:
                        return
            await asyncio.sleep(0)


def ask(llm: LLM, stream: bool) -> str:
    async def go() -> str:
        service = OpenAIService(EngineCluster(llm), llm.engine.tokenizer, "tiny")
        app = build_app(service, ServeConfig(model="tiny", api_key=None))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://test") as http:
            client = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1",
                                        http_client=http)
            if not stream:
                response = await client.chat.completions.create(
                    model="tiny", messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
                return response.choices[0].message.content or ""
            chunks = await client.chat.completions.create(
                model="tiny", messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0,
                stream=True)
            return "".join([chunk.choices[0].delta.content or "" async for chunk in chunks
                            if chunk.choices])

    return asyncio.run(go())


def test_an_eagle_head_answers_through_the_openai_client_as_the_plain_engine(
        tiny_chat_model, tmp_path):
    plain = LLM(str(tiny_chat_model), device="cpu", dtype="float32")
    expected = plain.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    plain.engine.shutdown()
    write_head(tmp_path / "head", "eagle3", vocab=49152,
               config_extra={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]})
    llm = LLM(str(tiny_chat_model), device="cpu", dtype="float32",
              speculative_config={"method": "eagle3", "model": str(tmp_path / "head"),
                                  "num_speculative_tokens": 3, "adaptive": False})
    text = expected[0].outputs[0].text
    assert text and ask(llm, stream=False) == text
    assert ask(llm, stream=True) == text
    assert llm.stats().spec_decode_num_drafts > 0  # the head drafted, the target verified
