"""The model's tokenizer, its end-of-sequence ids and its chat template."""

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cluster.engine.tool_messages import for_plain_template, for_tool_template, knows_tools
from router.tool_calls import Tool

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

Message = dict[str, Any]  # role and content; an assistant's tool_calls, a tool's tool_call_id


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None when it has none (prompts are then token ids)."""
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def eos_token_ids(folder: Path, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, together."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def check_text(text: str, what: str) -> None:
    """Raises ValueError unless ``text`` encodes to UTF-8. JSON's escapes let a client send a
    lone surrogate ("\\ud800"), which Python holds in a str but no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not valid UTF-8 text: character {error.start} is a lone "
                         f"surrogate ({text[error.start]!r}), which has no encoding") from None


def apply_chat_template(tokenizer: PreTrainedTokenizerBase | None, messages: list[Message],
                        tools: list[Tool] | None = None) -> list[int]:
    """The conversation's prompt ids, ending with the assistant's turn. ``tools``: the
    functions the model is offered (tool_messages.py writes them for a template that has
    no place for them); messages' tool calls are rendered either way."""
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("this model has no chat template: use generate() with a prompt")
    if not messages:
        raise ValueError("messages must not be empty")
    for index, message in enumerate(messages):
        for key, value in message.items():
            if isinstance(value, str):
                check_text(value, f"messages[{index}].{key}")
    extra: dict[str, Any] = {}
    if knows_tools(tokenizer.chat_template):
        messages = for_tool_template(messages)
        if tools:
            extra["tools"] = [tool.as_openai() for tool in tools]
    elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = for_plain_template(messages, tools or [])
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False, **extra)
    except TemplateError as error:  # the template's raise_exception(): roles out of order, ...
        raise ValueError(f"the model's chat template refused these messages: {error}") from None
    return tokenizer.encode(text, add_special_tokens=False)
