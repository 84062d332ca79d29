"""The model's tokenizer, its end-of-sequence ids and its chat template."""

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

Message = dict[str, str]


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


def apply_chat_template(tokenizer: PreTrainedTokenizerBase | None,
                        messages: list[Message]) -> list[int]:
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("this model has no chat template: use generate() with a prompt")
    if not messages:
        raise ValueError("messages must not be empty")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
