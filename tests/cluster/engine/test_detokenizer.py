"""Incremental detokenization: the streamed pieces add up to the whole decode, both ways."""

import pytest

from cluster.engine.detokenizer import (
    CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StreamDetokenizer,
    special_ids,
)
from cluster.engine.tokenizer import load_tokenizer
from workers.catalog import DEFAULT_MODEL, model_path

pytestmark = pytest.mark.slow

TEXTS = ["Hello world, how are you?", " leading space and  double", "日本語 🎉 emoji 👍🏽 ok",
         "code:\n\tdef f(x):\n\t\treturn x**2\n", "naïve café — “quotes”"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(model_path(DEFAULT_MODEL))


def python_detokenizer(tokenizer, prompt_ids):
    special = special_ids(tokenizer)
    context = [t for t in prompt_ids if t not in special][-CONTEXT_TOKENS:]
    return IncrementalDetokenizer(tokenizer, special, context, 0, len(context))


@pytest.mark.parametrize("text", TEXTS)
def test_both_detokenizers_stream_the_whole_text(tokenizer, text):
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    ids = tokenizer.encode(text)
    ids = ids[:3] + [tokenizer.eos_token_id] + ids[3:]  # a special token never reaches the text
    fast = IncrementalDetokenizer.for_prompt(tokenizer, prompt)
    slow = python_detokenizer(tokenizer, prompt)
    assert isinstance(fast, StreamDetokenizer)
    pieces, slow_pieces = [fast.add(t) for t in ids], [slow.add(t) for t in ids]
    assert "".join(pieces) == fast.text == text
    assert "".join(slow_pieces) == slow.text == text
    # a character split over several byte tokens comes out whole, never as U+FFFD
    assert all("\ufffd" not in piece for piece in pieces)
