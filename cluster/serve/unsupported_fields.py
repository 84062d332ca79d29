"""Fields a request may not carry, and how a 400 names them.

Every request body is strict (``extra="forbid"``): an option tandem does not implement is
refused with its name rather than silently ignored, since a client that sends ``tools`` or
``suffix`` would otherwise get an answer that quietly did not do what it asked. OpenAI's
and vLLM's own fields that tandem does not implement are told apart from names nobody knows
(a typo), as OpenAI tells them apart.

Clients that build bodies generically send some of these fields with a value that asks for
nothing (``"tools": null``, ``"functions": []``) or for exactly what tandem does anyway
(``"skip_special_tokens": true``); such a field is dropped before validation, not refused.
"""

from collections.abc import Mapping, Sequence, Set
from typing import Any

# OpenAI's fields of completions and chat completions that tandem does not implement
OPENAI_FIELDS = frozenset({
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "suffix", "audio", "modalities", "prediction", "store", "metadata", "service_tier",
    "reasoning_effort", "web_search_options", "verbosity", "prompt_cache_key",
    "prompt_cache_retention", "safety_identifier",
})
# vLLM's extensions that tandem does not implement (it has min_tokens, ignore_eos, top_k, and
# structured outputs: structured_fields.py; a whitespace pattern it cannot follow is refused)
VLLM_FIELDS = frozenset({
    "use_beam_search", "length_penalty", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "guided_whitespace_pattern", "add_special_tokens",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
    "documents", "priority",
    "request_id", "return_tokens_as_token_ids", "logits_processors", "kv_transfer_params",
    "vllm_xargs", "mm_processor_kwargs", "echo",
})
REQUEST_FIELDS = OPENAI_FIELDS | VLLM_FIELDS
# a chat message's fields besides role and content (an assistant's tool calls, a name)
MESSAGE_FIELDS = frozenset({"name", "tool_calls", "tool_call_id", "function_call", "refusal",
                            "audio", "annotations", "reasoning_content"})
KNOWN_FIELDS = REQUEST_FIELDS | MESSAGE_FIELDS

# values that ask for what tandem does anyway: special tokens never reach the text, stop
# strings are cut, the chat template always ends with the assistant's turn
SAME_AS_TANDEM: Mapping[str, object] = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
    "add_generation_prompt": True, "continue_final_message": False, "echo": False,
    "store": False, "tool_choice": "none",
}


def asks_nothing(name: str, value: object) -> bool:
    """Whether a known but unimplemented field's value may be ignored: it asks for nothing
    (null or empty), or for what tandem does anyway."""
    if value is None or value in ("", [], {}):
        return True
    same = SAME_AS_TANDEM.get(name, ...)
    # True == 1 in Python: a flag's value must be a flag
    return value == same and isinstance(value, bool) == isinstance(same, bool)


def without_empty(data: Any, names: Set[str]) -> Any:
    """``data`` (a body's JSON object, before validation) without its ``names`` fields that
    ask nothing; anything else is left for validation, which refuses what remains."""
    if not isinstance(data, dict):
        return data
    return {key: value for key, value in data.items()
            if not (key in names and asks_nothing(key, value))}


def field_path(loc: Sequence[str | int]) -> str:
    """("messages", 0, "name") -> "messages[0].name", as OpenAI writes a nested param."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def refusal(locs: Sequence[Sequence[str | int]]) -> tuple[str, str, str]:
    """The message, param and code of a 400 for these extra fields (their paths), each kind
    in alphabetical order (pydantic reports them in no order a client could predict)."""
    known = sorted(field_path(loc) for loc in locs if loc and loc[-1] in KNOWN_FIELDS)
    unknown = sorted(field_path(loc) for loc in locs if not loc or loc[-1] not in KNOWN_FIELDS)
    parts = []
    if known:
        parts.append(f"Unsupported parameter{'s' if len(known) > 1 else ''}: {quoted(known)} "
                     f"{'are' if len(known) > 1 else 'is'} not supported by tandem")
    if unknown:
        parts.append(f"{'unknown' if known else 'Unknown'} parameter"
                     f"{'s' if len(unknown) > 1 else ''}: {quoted(unknown)}")
    code = "unsupported_parameter" if known else "unknown_parameter"
    return "; ".join(parts) + ".", (known or unknown)[0], code


def quoted(names: Sequence[str]) -> str:
    return ", ".join(f"'{name}'" for name in names)
