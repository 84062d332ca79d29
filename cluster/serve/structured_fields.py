"""The request fields that constrain what a model may output, as the engine takes them.

Clients ask for structured output in several spellings: OpenAI's ``response_format``, vLLM's
``structured_outputs`` object, and vLLM's older ``guided_*`` fields. Each becomes one
``StructuredOutputs``; a request that asks in two places is refused rather than one of them
picked, and a spelling tandem cannot honour (a whitespace pattern) is refused rather than
ignored. ``logit_bias`` is here too: it is the other field that changes which tokens may come.

Every problem is a 400 that names the field the client used, with the constraint checked
for compiling here: the engine would find the same problem only after the request is queued,
and its errors name the prompt.
"""

from collections.abc import Callable
from typing import Any

from cluster.serve.openai_errors import bad_request
from cluster.serve.protocol import SamplingFields
from router.structured_outputs import StructuredOutputs

# vLLM's guided_decoding_backend values that mean what tandem does (it has xgrammar only)
BACKENDS = ("xgrammar", "auto")
# response_format's json_schema object: OpenAI's keys (strict is what tandem does anyway)
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
# the older guided_* fields, each the structured_outputs key it means
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def output_constraint(request: SamplingFields,
                      check: Callable[[StructuredOutputs], None] | None = None,
                      ) -> tuple[StructuredOutputs | None, str | None]:
    """The request's one constraint and the field it came from, or (None, None). ``check``
    (the backend's ``check_convertible``, by default) raises ValueError when it does not
    compile; it is a parameter so that the mapping can be tested without the backend."""
    check_backend(request.guided_decoding_backend)
    asked = [(param, fields) for param, fields in asked_constraints(request)
             if fields is not None]
    if len(asked) > 1:
        first, second = asked[0][0], asked[1][0]
        raise bad_request(f"conflicting constraints: {second} and {first} both constrain the "
                          "output; send only one of them", second, code="invalid_value")
    if not asked:
        return None, None
    param, fields = asked[0]
    try:
        structured = StructuredOutputs(**fields)
        (check or convertible)(structured)
    except ValueError as error:
        raise bad_request(str(error), param, code="invalid_value") from error
    return structured, param


def asked_constraints(request: SamplingFields) -> list[tuple[str, dict[str, Any] | None]]:
    """Each spelling's StructuredOutputs fields (None: it asks nothing), in the order a
    conflict is reported: OpenAI's field first, then vLLM's, then vLLM's older ones."""
    return [
        ("response_format", from_response_format(request.response_format)),
        ("structured_outputs", from_structured_outputs(request.structured_outputs)),
        *((name, None if getattr(request, name) is None else {key: getattr(request, name)})
          for name, key in GUIDED_FIELDS.items()),
    ]


def from_response_format(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", ...}``."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_request(f"response_format type {kind!r} is not supported: use 'text', "
                          "'json_object' or 'json_schema'", "response_format",
                          code="unsupported_value")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request("response_format of type 'json_schema' needs a json_schema object "
                          "with the schema in its 'schema' field", "response_format",
                          code="invalid_value")
    unknown = sorted(set(spec) - JSON_SCHEMA_KEYS)
    if unknown:  # a key we would ignore might have asked for something
        raise bad_request(f"response_format.json_schema has unknown keys: {', '.join(unknown)}"
                          f" (it takes {', '.join(sorted(JSON_SCHEMA_KEYS))})",
                          "response_format", code="invalid_value")
    return {"json": spec["schema"]}


def from_structured_outputs(given: Any) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs`` object (protocol's ``StructuredOutputsField``). One with
    no constraint asks nothing, as an empty field elsewhere does. Whitespace between JSON
    tokens stays off whatever ``disable_any_whitespace`` says: small models loop on it."""
    if given is None:
        return None
    fields = {key: value for key in ("json", "regex", "choice", "grammar", "json_object")
              if (value := getattr(given, "json_" if key == "json" else key)) not in (None, False)}
    return fields or None


def check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise bad_request(f"guided_decoding_backend {backend!r} is not supported: tandem's "
                          f"backend is xgrammar (send {' or '.join(map(repr, BACKENDS))}, or "
                          "leave it out)", "guided_decoding_backend", code="unsupported_value")


def convertible(structured: StructuredOutputs) -> None:
    from workers.structured.backend import check_convertible  # xgrammar, imported when used

    check_convertible(structured)


def token_biases(logit_bias: dict[str, float] | None,
                 vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's ``{"<token id>": bias}`` with int keys; ids past ``vocab_size`` (when known)
    refused here, naming the field, rather than by the engine, naming the prompt. Ranges of
    the biases are SamplingParams' to check."""
    if not logit_bias:
        return None
    biases = {}
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r}",
                              "logit_bias", code="invalid_value") from None
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is out of range for a vocabulary "
                              f"of {vocab_size}", "logit_bias", code="invalid_value")
        biases[token] = value
    return biases


def engine_error_param(message: str | None, constraint_param: str | None) -> str:
    """The field an engine refusal is about: the engine's checks of logit_bias and of the
    constraint say so in their first words; anything else it refuses is the prompt."""
    if message and message.startswith("logit_bias"):
        return "logit_bias"
    if message and constraint_param and message.startswith(("structured_outputs",
                                                            "structured outputs")):
        return constraint_param
    return "prompt"

