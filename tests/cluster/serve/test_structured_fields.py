"""Structured outputs and logit_bias over HTTP: each spelling a client may use (OpenAI's
response_format, vLLM's structured_outputs and guided_* fields) maps to one StructuredOutputs,
and each problem is a 400 naming the field the client used. Unit tests of the mapping, then a
few requests through the fake cluster of test_protocol."""

import pytest

from cluster.serve.openai_errors import APIError
from cluster.serve.protocol import ChatCompletionRequest, CompletionRequest
from cluster.serve.structured_fields import (
    engine_error_param,
    output_constraint,
    token_biases,
)
from router.structured_outputs import StructuredOutputs
from tests.cluster.serve.test_openai_extras import CharTokenizer, RecordingCluster, post
from tests.cluster.serve.test_request_limits import QUESTION, call, error_of, invalid

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
JSON_SCHEMA = {"type": "json_schema",
               "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def constraint(**fields):
    """The mapping of a completions body with these fields, without the backend's check."""
    return output_constraint(CompletionRequest.model_validate({"prompt": [1], **fields}),
                             check=lambda structured: None)


def refusal(**fields) -> dict:
    with pytest.raises(APIError) as caught:
        output_constraint(CompletionRequest.model_validate({"prompt": [1], **fields}))
    assert caught.value.status == 400
    return caught.value.info.model_dump()


# -- the mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, expected, source", [
    ({"response_format": JSON_SCHEMA}, StructuredOutputs(json=SCHEMA), "response_format"),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True),
     "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=SCHEMA),
     "structured_outputs"),
    ({"structured_outputs": {"json": '{"type": "integer"}'}},
     StructuredOutputs(json={"type": "integer"}), "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
     StructuredOutputs(regex="[a-z]+"), "structured_outputs"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs(choice=("yes", "no")),
     "structured_outputs"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutputs(grammar='root ::= "a"'), "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True),
     "structured_outputs"),
    ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA), "guided_json"),
    ({"guided_regex": "\\d+"}, StructuredOutputs(regex="\\d+"), "guided_regex"),
    ({"guided_choice": ["a", "b"]}, StructuredOutputs(choice=("a", "b")), "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputs(grammar='root ::= "x"'),
     "guided_grammar"),
    ({"guided_regex": "x", "guided_decoding_backend": "xgrammar"}, StructuredOutputs(regex="x"),
     "guided_regex"),
    ({"guided_regex": "x", "guided_decoding_backend": "auto"}, StructuredOutputs(regex="x"),
     "guided_regex"),
])
def test_each_spelling_maps_to_one_constraint(fields, expected, source):
    assert constraint(**fields) == (expected, source)


@pytest.mark.parametrize("fields", [
    {}, {"response_format": {"type": "text"}}, {"response_format": None},
    {"structured_outputs": None}, {"structured_outputs": {}},
    {"structured_outputs": {"json_object": False}}, {"guided_json": None},
    {"guided_decoding_backend": "xgrammar"},
])
def test_fields_that_ask_nothing_map_to_no_constraint(fields):
    assert constraint(**fields) == (None, None)


def test_the_same_mapping_on_chat():
    request = ChatCompletionRequest.model_validate({"messages": QUESTION,
                                                    "response_format": JSON_SCHEMA})
    assert output_constraint(request, check=lambda s: None) == (
        StructuredOutputs(json=SCHEMA), "response_format")


@pytest.mark.parametrize("fields, second, first", [
    ({"response_format": JSON_SCHEMA, "guided_regex": "x"}, "guided_regex", "response_format"),
    ({"structured_outputs": {"regex": "x"}, "guided_json": SCHEMA}, "guided_json",
     "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs", "response_format"),
    ({"guided_choice": ["a"], "guided_grammar": 'root ::= "a"'}, "guided_grammar",
     "guided_choice"),
])
def test_two_constraints_are_refused_naming_the_second(fields, second, first):
    assert refusal(**fields) == invalid(
        f"conflicting constraints: {second} and {first} both constrain the output; send only "
        "one of them", second, "invalid_value")


@pytest.mark.parametrize("response_format, message, code", [
    ({"type": "json_schema"}, "response_format of type 'json_schema' needs a json_schema "
     "object with the schema in its 'schema' field", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format of type "
     "'json_schema' needs a json_schema object with the schema in its 'schema' field",
     "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format "
     "of type 'json_schema' needs a json_schema object with the schema in its 'schema' field",
     "invalid_value"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strictness": 1}},
     "response_format.json_schema has unknown keys: strictness (it takes description, name, "
     "schema, strict)", "invalid_value"),
    ({"type": "structural_tag"}, "response_format type 'structural_tag' is not supported: use "
     "'text', 'json_object' or 'json_schema'", "unsupported_value"),
    ({}, "response_format type None is not supported: use 'text', 'json_object' or "
     "'json_schema'", "unsupported_value"),
])
def test_a_response_format_tandem_cannot_follow_is_named(response_format, message, code):
    assert refusal(response_format=response_format) == invalid(message, "response_format", code)


def test_another_backend_is_refused():
    assert refusal(guided_regex="x", guided_decoding_backend="outlines") == invalid(
        "guided_decoding_backend 'outlines' is not supported: tandem's backend is xgrammar "
        "(send 'xgrammar' or 'auto', or leave it out)", "guided_decoding_backend",
        "unsupported_value")


@pytest.mark.parametrize("fields, message, param", [
    ({"guided_regex": "a("}, "structured_outputs.regex does not compile: Regex parsing error "
     "at position 3: The parenthesis is not closed.", "guided_regex"),
    ({"structured_outputs": {"json": {"$ref": "#/$defs/x"}}}, "structured_outputs.json does "
     "not compile: Cannot find field '$defs' in #/$defs/x", "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "the JSON schema keyword 'uniqueItems' (at #) is not supported: tandem's grammar backend "
     "cannot enforce it, and an output breaking it would pass", "response_format"),
    ({"guided_json": "{not json"}, "structured_outputs.json is not valid JSON: Expecting "
     "property name enclosed in double quotes: line 1 column 2 (char 1)", "guided_json"),
    ({"guided_choice": []}, "structured_outputs.choice must hold at least one string",
     "guided_choice"),
    ({"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}}, "structured outputs "
     "take exactly one of json, regex, choice, grammar, json_object, structural_tag; got "
     "regex, grammar", "structured_outputs"),
])
def test_a_constraint_that_does_not_build_is_named_by_its_field(fields, message, param):
    assert refusal(**fields) == invalid(message, param, "invalid_value")


# -- logit_bias -------------------------------------------------------------------------------


def test_logit_bias_keys_become_token_ids():
    assert token_biases({"42": 10.0, "7": -100}, 100) == {42: 10.0, 7: -100}
    assert token_biases({"99": 1.0}, None) == {99: 1.0}  # no tokenizer: the engine checks
    assert token_biases({}, 100) is None and token_biases(None, 100) is None


@pytest.mark.parametrize("bias, message", [
    ({"a": 1.0}, "logit_bias keys must be token ids (integers), got 'a'"),
    ({"1.5": 1.0}, "logit_bias keys must be token ids (integers), got '1.5'"),
    ({"100": 1.0}, "logit_bias token id 100 is out of range for a vocabulary of 100"),
    ({"-1": 1.0}, "logit_bias token id -1 is out of range for a vocabulary of 100"),
])
def test_logit_bias_keys_that_are_not_token_ids_are_named(bias, message):
    with pytest.raises(APIError) as caught:
        token_biases(bias, 100)
    assert caught.value.info.model_dump() == invalid(message, "logit_bias", "invalid_value")


def test_engine_refusals_name_the_field_they_are_about():
    assert engine_error_param("logit_bias token id 9 is out of range for a vocabulary of 8",
                              None) == "logit_bias"
    assert engine_error_param("structured_outputs.regex does not compile: x",
                              "guided_regex") == "guided_regex"
    assert engine_error_param("structured outputs need the model's tokenizer, and this model "
                              "has none", "response_format") == "response_format"
    assert engine_error_param("prompt has token ids out of range", "guided_regex") == "prompt"
    assert engine_error_param(None, None) == "prompt"


# -- over HTTP, through the fake cluster -------------------------------------------------------


@pytest.mark.parametrize("route, body", [
    ("chat/completions", {"messages": QUESTION}),
    ("completions", {"prompt": [1, 2], "n": 2}),
])
def test_a_json_schema_request_reaches_the_cluster_with_its_constraint(route, body):
    cluster = RecordingCluster()
    response = call("POST", f"/v1/{route}", {**body, "response_format": JSON_SCHEMA,
                                            "logit_bias": {"104": 5}}, cluster=cluster)
    assert response.status_code == 200, response.text
    assert [(p.structured_outputs, p.logit_bias) for p in cluster.params] == [
        (StructuredOutputs(json=SCHEMA), {104: 5.0})]


def test_guided_fields_reach_the_cluster_over_http():
    cluster = RecordingCluster()
    response = call("POST", "/v1/completions", {"prompt": [1], "guided_choice": ["yes", "no"],
                                                "guided_decoding_backend": "auto"},
                    cluster=cluster)
    assert response.status_code == 200, response.text
    assert cluster.params[0].structured_outputs == StructuredOutputs(choice=("yes", "no"))


@pytest.mark.parametrize("body, message, param", [
    ({"response_format": JSON_SCHEMA, "guided_regex": "x"}, "conflicting constraints: "
     "guided_regex and response_format both constrain the output; send only one of them",
     "guided_regex"),
    ({"guided_regex": "a("}, "structured_outputs.regex does not compile: Regex parsing error "
     "at position 3: The parenthesis is not closed.", "guided_regex"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids (integers), got 'x'",
     "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias values must be in [-100, 100]", "logit_bias"),
    ({"guided_json": SCHEMA, "ignore_eos": True}, "ignore_eos cannot be used with structured "
     "outputs: the grammar decides where the output ends", "ignore_eos"),
])
def test_http_refusals_name_the_field_and_reach_no_cluster(body, message, param):
    cluster = RecordingCluster()
    error = error_of(call("POST", "/v1/chat/completions", {"messages": QUESTION, **body},
                          cluster=cluster))
    assert error == invalid(message, param, "invalid_value")
    assert cluster.started == []


def test_a_whitespace_pattern_is_refused_not_ignored():
    error = error_of(call("POST", "/v1/completions", {"prompt": [1], "guided_regex": "a",
                                                      "guided_whitespace_pattern": " *"}))
    assert error == invalid("Unsupported parameter: 'guided_whitespace_pattern' is not "
                            "supported by tandem.", "guided_whitespace_pattern",
                            "unsupported_parameter")


class SizedTokenizer(CharTokenizer):
    def __len__(self):
        return 128


def test_a_token_id_past_the_tokenizers_vocabulary_is_named_before_the_cluster():
    cluster = RecordingCluster()
    response = post({"prompt": [1], "logit_bias": {"128": 1}}, cluster, SizedTokenizer())
    assert error_of(response) == invalid(
        "logit_bias token id 128 is out of range for a vocabulary of 128", "logit_bias",
        "invalid_value")
    assert cluster.started == []
    assert post({"prompt": [1], "logit_bias": {"127": 1}}, cluster,
                SizedTokenizer()).status_code == 200
