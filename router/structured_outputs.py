"""What a request's output must match: a JSON schema, a regex, one of some choices, an EBNF
grammar, or a structural tag (tool calls). Checked when the request is made; compiled and
enforced by workers/structured/.

Fail closed: a JSON schema keyword the grammar backend would accept but not enforce (a
``uniqueItems`` array could then repeat items) is refused here with its path, rather than
answered with output that breaks the schema the client gave.
"""

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# keywords xgrammar 0.2.9 compiles but does not enforce (an instance breaking them is
# accepted: tests/workers/structured/test_refused_keywords.py shows each)
UNENFORCED_KEYWORDS = frozenset({
    "uniqueItems", "not", "contains", "maxContains", "if", "then", "else", "dependentSchemas",
    "dependentRequired", "dependencies", "unevaluatedProperties",
})
# string formats xgrammar enforces; any other is refused (it would be a plain string)
ENFORCED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uri-template", "uuid", "json-pointer",
})
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar of a megabyte is a mistake or an attack
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint. ``json`` is a schema (a dict, or its JSON text); ``choice`` a
    list of strings, the output being one of them exactly; ``grammar`` EBNF (xgrammar's
    GBNF dialect); ``json_object`` any JSON object; ``structural_tag`` xgrammar's structural
    tag (what tool calls compile to). ``whitespace``: free whitespace between JSON tokens
    (off by default: small models loop on it)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict[str, Any] | None = None
    whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):  # a schema given as text is parsed here, once
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        for problem in self._problems():
            raise ValueError(problem)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: what the backend compiles, and the compile cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "regex" or self.kind == "grammar":
            return str(value)
        if self.kind == "json_object":
            return '{"type": "object"}'
        return json.dumps(value)  # key order kept: it is the order properties come out in

    @property
    def key(self) -> tuple[str, str, bool]:
        return (self.kind, self.spec, self.whitespace)

    def _problems(self) -> list[str]:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            return [f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                    f"{', '.join(given) if given else 'none'}"]
        kind = given[0]
        value = getattr(self, kind)
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            return [f"structured_outputs.{kind} must be a non-empty string"]
        if kind == "choice":
            return choice_problems(value)
        if kind == "json":
            if not isinstance(value, dict):
                return ["structured_outputs.json must be a JSON schema object, got "
                        f"{type(value).__name__}"]
            return schema_problems(value)
        if kind == "structural_tag" and not isinstance(value, dict):
            return ["structured_outputs.structural_tag must be an object"]
        if len(self.spec) > MAX_SPEC_CHARS:
            return [f"structured_outputs.{kind} is longer than {MAX_SPEC_CHARS} characters"]
        return []


def choice_problems(choices: tuple[str, ...]) -> list[str]:
    if not choices:
        return ["structured_outputs.choice must hold at least one string"]
    if len(choices) > MAX_CHOICES:
        return [f"structured_outputs.choice may hold at most {MAX_CHOICES} strings"]
    if not all(isinstance(c, str) and c for c in choices):
        return ["structured_outputs.choice must hold non-empty strings"]
    return []


def schema_problems(schema: dict[str, Any]) -> list[str]:
    """The first keyword of ``schema`` that the backend would not enforce, with its path."""
    if len(json.dumps(schema)) > MAX_SPEC_CHARS:
        return [f"the JSON schema is longer than {MAX_SPEC_CHARS} characters"]
    found = unenforced(schema, "#")
    return [found] if found else []


def unenforced(node: Any, path: str) -> str | None:
    if isinstance(node, list):
        for index, item in enumerate(node):
            found = unenforced(item, f"{path}/{index}")
            if found:
                return found
        return None
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions"):  # names of the user's, not keywords
            if isinstance(value, dict):
                for name, sub in value.items():
                    found = unenforced(sub, f"{path}/{key}/{name}")
                    if found:
                        return found
            continue
        if key in ("enum", "const", "default", "examples", "description", "title"):
            continue  # values, not schemas
        if key in UNENFORCED_KEYWORDS:
            return (f"the JSON schema keyword '{key}' (at {path}) is not supported: tandem's "
                    "grammar backend cannot enforce it, and an output breaking it would pass")
        if key == "format" and value not in ENFORCED_FORMATS:
            return (f"the JSON schema format {value!r} (at {path}) is not supported: tandem "
                    f"enforces {', '.join(sorted(ENFORCED_FORMATS))}")
        found = unenforced(value, f"{path}/{key}")
        if found:
            return found
    return None
