"""A constrained request on two shards over Ray: the grammar travels to rank 0's process as
its JSON (workers/structured/backend.py GrammarRef) and gives the tokens of one shard."""

import json

import jsonschema
import pytest

from cluster import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["color", "size", "tags"]}


@pytest.mark.ray
def test_tensor_parallel_2_gives_the_one_shard_tokens(ray_session, tiny_chat_model):
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=0.0, max_tokens=8,
                             structured_outputs={"choice": ["alpha", "beta"]})]
    prompts = ["Describe a box:", "Pick one:"]
    one = LLM(str(tiny_chat_model), device="cpu", block_size=4, num_kv_blocks=128)
    expected = [o.outputs[0] for o in one.generate(prompts, params)]
    two = LLM(str(tiny_chat_model), device="cpu", block_size=4, num_kv_blocks=128,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        outs = [o.outputs[0] for o in two.generate(prompts, params)]
    finally:
        two.engine.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert outs[1].text in ("alpha", "beta")
    if outs[0].finish_reason == "stop":  # random weights may run out of tokens first
        jsonschema.validate(json.loads(outs[0].text), SCHEMA)
