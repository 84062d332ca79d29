"""The grammar backend behind a small seam: xgrammar, imported only when a request needs it.

Two things cross the seam: ``compile`` (a request's StructuredOutputs into a compiled
grammar, for one tokenizer) and ``GrammarMatcher`` over a compiled grammar (accept a token,
fill a row of the allowed-token bitmask, roll back). Another backend (llguidance) would
implement the same two.

A compiled grammar travels to the worker that samples (rank 0) inside the step's
``NewRequest``: as the object itself when the worker shares the engine's process, and as its
JSON with the tokenizer's folder when pickled for a shard actor (``GrammarRef``), where it
is rebuilt once per grammar and per process.
"""

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class StructuredOutputs(Protocol):
    """What the backend reads of a request's constraint (router.structured_outputs'
    dataclass; workers may not import the router, so the seam names only its fields)."""

    @property
    def kind(self) -> str: ...
    @property
    def spec(self) -> str: ...
    @property
    def whitespace(self) -> bool: ...
    @property
    def choice(self) -> tuple[str, ...] | None: ...
    @property
    def key(self) -> tuple[str, str, bool]: ...

# compact JSON: no free whitespace (small models loop on it), OpenAI's separators
SEPARATORS = (", ", ": ")
CACHE_BYTES = 256 << 20
_HEADER = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[11:21:45] file.cc:123: "


def backend_message(error: Exception) -> str:
    """xgrammar's message without its C++ source location, first line only."""
    text = _HEADER.sub("", str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__


_convertible: "OrderedDict[tuple[str, str, bool], None]" = OrderedDict()
MAX_CHECKED = 1024


def check_convertible(structured: StructuredOutputs) -> None:
    """Raises ValueError, naming the field, when the backend cannot turn the constraint into
    a grammar (a bad regex, a ``$ref`` to nothing, EBNF that does not parse). Needs no
    tokenizer: the API layer runs it before anything is queued. A spec that passed before
    passes at once (building its grammar again took ~0.4 ms of every request's TTFT)."""
    key = structured.key
    if key in _convertible:
        return
    try:
        to_grammar(structured)
    except Exception as error:  # xgrammar raises RuntimeError (and a few others) with a message
        raise ValueError(f"structured_outputs.{structured.kind} does not compile: "
                         f"{backend_message(error)}") from None
    _convertible[key] = None
    if len(_convertible) > MAX_CHECKED:
        _convertible.popitem(last=False)


def to_grammar(structured: StructuredOutputs) -> Any:
    """The constraint as an xgrammar ``Grammar`` (no token-level work: ~0.1 ms)."""
    import xgrammar as xgr

    kind, spec, whitespace = structured.kind, structured.spec, structured.whitespace
    if kind in ("json", "json_object"):
        return xgr.Grammar.from_json_schema(spec, any_whitespace=whitespace,
                                            separators=None if whitespace else SEPARATORS)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(structured.choice or ()))
    tag = compact_json(json.loads(spec), whitespace)
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


def compact_json(node: Any, whitespace: bool) -> Any:
    """A structural tag whose JSON contents follow the JSON mode's whitespace rule: xgrammar
    lets any whitespace into a tag's ``json_schema`` content, so each becomes the EBNF of
    ``from_json_schema`` (compact unless ``whitespace``). Tool-call arguments are then
    exactly what json.dumps writes, which the streamed calls rely on."""
    import xgrammar as xgr

    if isinstance(node, list):
        return [compact_json(item, whitespace) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(node["json_schema"]), any_whitespace=whitespace,
            separators=None if whitespace else SEPARATORS)
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: compact_json(value, whitespace) for key, value in node.items()}


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """One alternative per choice, each a JSON-escaped literal (EBNF takes JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


class GrammarCompiler:
    """One tokenizer's compiler with a cache (xgrammar's, by spec): thread-safe, releases the
    GIL while it compiles, so the engine runs it on a small thread pool."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int],
                 folder: Path, max_threads: int = 2) -> None:
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads,
                                            cache_enabled=True, cache_limit_bytes=CACHE_BYTES)
        self.source = (str(folder), vocab_size, tuple(stop_ids))
        self.without_controls = {ws: control_free_row(self.info, ws) for ws in (False, True)}

    def compile(self, structured: StructuredOutputs) -> "GrammarRef":
        # xgrammar's cache keys on the grammar: a spec compiled before comes back in ~0.02 ms
        compiled = self.compiler.compile_grammar(to_grammar(structured))
        json_kind = structured.kind in ("json", "json_object")
        return GrammarRef(structured.key, self.source, compiled,
                          self.without_controls[structured.whitespace] if json_kind else None)


def control_free_row(info: Any, whitespace: bool) -> Any:
    """A bitmask row (int32 words) allowing every token but those whose bytes hold a control
    character: JSON has none in its strings (xgrammar's string rule lets them through, and a
    strict parser refuses the result), nor between tokens unless whitespace is free (then
    tab, newline and carriage return stay)."""
    import torch

    allowed = set(b"\t\n\r") if whitespace else set()
    words = [-1] * -(-info.vocab_size // 32)
    for token_id, raw in enumerate(info.decoded_vocab):
        if any(byte < 0x20 and byte not in allowed for byte in raw):
            words[token_id // 32] &= ~(1 << (token_id % 32))
    row = torch.tensor([w & 0xFFFFFFFF for w in words], dtype=torch.int64)
    return row.to(torch.int32)  # wraps to the int32 bit pattern


@dataclass(eq=False)
class GrammarRef:
    """A compiled grammar on its way to the sampling worker. ``source`` (the tokenizer's
    folder, the model's vocabulary size and stop ids) rebuilds it in another process."""

    key: tuple[str, str, bool]
    source: tuple[str, int, tuple[int, ...]]
    compiled: Any = field(default=None, repr=False)
    # JSON's rows are also ANDed with this (control_free_row), or None
    and_row: Any = field(default=None, repr=False)

    # the compiled grammar as JSON, made by the first pickling (a shard in another process):
    # a GrammarRef is shared by the requests of one spec, so once per spec
    serialized: str | None = field(default=None, repr=False)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        if self.serialized is None:
            self.serialized = self.compiled.serialize_json()
        return (_rebuild, (self.key, self.source, self.serialized, self.and_row))


_lock = threading.Lock()
_infos: dict[tuple[str, int, tuple[int, ...]], Any] = {}
_grammars: "OrderedDict[tuple[Any, ...], Any]" = OrderedDict()
MAX_REBUILT = 256


def _rebuild(key: tuple[str, str, bool], source: tuple[str, int, tuple[int, ...]],
             text: str, and_row: Any) -> GrammarRef:
    """In a shard's process: the same grammar, from its JSON, deserialized once per key."""
    import xgrammar as xgr

    with _lock:
        cached = _grammars.get((source, key))
        if cached is not None:
            _grammars.move_to_end((source, key))
            return GrammarRef(key, source, cached, and_row)
        info = _infos.get(source)
        if info is None:
            from transformers import AutoTokenizer

            folder, vocab_size, stop_ids = source
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            info = _infos[source] = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        compiled = xgr.CompiledGrammar.deserialize_json(text, info)
        _grammars[(source, key)] = compiled
        if len(_grammars) > MAX_REBUILT:
            _grammars.popitem(last=False)
        return GrammarRef(key, source, compiled, and_row)
