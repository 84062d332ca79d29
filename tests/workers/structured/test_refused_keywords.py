"""Every schema keyword tandem refuses is one xgrammar would take without enforcing: each case
shows the backend accepting an instance that breaks it, and the request being refused. When a
new xgrammar enforces one, its case fails here, and the keyword can leave the refused list."""

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from router.sampling_params import SamplingParams
from router.structured_outputs import ENFORCED_FORMATS, UNENFORCED_KEYWORDS

INT = {"type": "integer"}
OBJECT_AB = {"type": "object", "properties": {"a": INT, "b": INT}}
CASES = {  # keyword: (a schema using it, an instance breaking it)
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]"),
    "not": ({"type": "integer", "not": {"const": 1}}, "1"),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]"),
    "maxContains": ({"type": "array", "items": INT, "contains": {"const": 5},
                     "maxContains": 1}, "[5, 5]"),
    "if": ({"type": "integer", "if": {"const": 1}, "then": {"const": 2}}, "1"),
    "then": ({"type": "integer", "if": {"const": 1}, "then": {"const": 2}}, "1"),
    "else": ({"type": "integer", "if": {"const": 1}, "else": {"const": 1}}, "2"),
    "dependentSchemas": ({**OBJECT_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
                         '{"a": 1}'),
    "dependentRequired": ({**OBJECT_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependencies": ({**OBJECT_AB, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "unevaluatedProperties": ({**OBJECT_AB, "unevaluatedProperties": False}, '{"c": 1}'),
}
# and keywords it does enforce (tandem takes them): the same kind of case, refused by it
ENFORCED_CASES = {
    "propertyNames": ({"type": "object", "additionalProperties": INT,
                       "propertyNames": {"maxLength": 1}}, '{"abc": 1}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "string"}}},
                          '{"x": 1}'),
    "unevaluatedItems": ({"type": "array", "prefixItems": [INT], "unevaluatedItems": False},
                         "[1, 2]"),
    "minProperties": ({"type": "object", "additionalProperties": INT, "minProperties": 2},
                      '{"a": 1}'),
    "maxProperties": ({"type": "object", "additionalProperties": INT, "maxProperties": 1},
                      '{"a": 1, "b": 2}'),
}


def accepts(schema: dict, instance: str) -> bool:
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=(", ", ": "), strict_mode=False)
    except RuntimeError:
        return True  # refused by the backend too: either way it is not enforced as written
    return _is_grammar_accept_string(grammar, instance)


def test_every_refused_keyword_has_a_case():
    assert set(CASES) == set(UNENFORCED_KEYWORDS)


@pytest.mark.parametrize("keyword", sorted(CASES))
def test_the_backend_lets_a_breaking_instance_through_and_tandem_refuses(keyword):
    schema, instance = CASES[keyword]
    assert accepts(schema, instance), f"xgrammar now enforces {keyword}: stop refusing it"
    with pytest.raises(ValueError) as error:
        SamplingParams(structured_outputs={"json": {"type": "object", "properties": {
            "field": schema}}})
    assert str(error.value).startswith("the JSON schema keyword '")
    assert "(at #/properties/field" in str(error.value)


@pytest.mark.parametrize("keyword", sorted(ENFORCED_CASES))
def test_keywords_the_backend_enforces_are_taken(keyword):
    schema, instance = ENFORCED_CASES[keyword]
    assert not accepts(schema, instance)
    assert SamplingParams(structured_outputs={"json": schema}).structured_outputs.json == schema


def test_unknown_formats_are_refused_and_known_ones_enforced():
    assert accepts({"type": "string", "format": "iri"}, '"not an iri !!"')
    with pytest.raises(ValueError, match="the JSON schema format 'iri' \\(at #\\) is not "
                                         "supported: tandem enforces date, date-time"):
        SamplingParams(structured_outputs={"json": {"type": "string", "format": "iri"}})
    for name in sorted(ENFORCED_FORMATS):
        assert not accepts({"type": "string", "format": name}, '"not a thing !!"'), name


def test_names_of_the_users_properties_are_not_keywords():
    schema = {"type": "object", "properties": {"not": INT, "contains": INT, "format": INT},
              "required": ["not"]}
    assert SamplingParams(structured_outputs={"json": schema}).structured_outputs.json == schema
