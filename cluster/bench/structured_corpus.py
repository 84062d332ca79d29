"""The structured-output specs that the tests sample through and `tandem bench structured`
compiles cold: JSON schemas of each kind a client sends (bounds, arrays, enums, unions, $ref,
patterns, nesting), a regex, a choice, an EBNF grammar and ``json_object``."""

from router.structured_outputs import StructuredOutputs

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["color", "ok"]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0,
                                                        "maximum": 999}, NAME]}},
     "required": ["id"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer",
               "minimum": -9, "maximum": 9}}, "required": ["x"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                      "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "list": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "minItems": 1, "maxItems": 4}}, "required": ["list"]}},
     "required": ["inner"]},
]
OTHERS = [
    StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"),
    StructuredOutputs(choice=("yes", "no", "maybe so")),
    StructuredOutputs(grammar='root ::= "(" [a-c]{1,4} ")" | "none"'),
    StructuredOutputs(json_object=True),
]


def corpus() -> list[StructuredOutputs]:
    return [StructuredOutputs(json=schema) for schema in SCHEMAS] + OTHERS
