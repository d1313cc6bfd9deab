"""Every request form becomes one GrammarSpec, and bad or oversized specs are ValueErrors that say
what was wrong."""

import json

import pytest

from pagedllm.structured import spec as spec_module
from pagedllm.structured.spec import (
    GrammarSpec,
    spec_from_request,
    spec_from_response_format,
    spec_from_structured_outputs,
)

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b"]}


def test_response_format_forms():
    assert spec_from_response_format({"type": "text"}) is None
    assert spec_from_response_format({"type": "json_object"}) == GrammarSpec("json_object")
    spec = spec_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert spec.kind == "json_schema" and json.loads(spec.text) == SCHEMA
    # Key order is kept: it is the order the properties are written in.
    assert list(json.loads(spec.text)["properties"]) == ["b", "a"]
    no_schema = {"type": "json_schema", "json_schema": {"name": "anything"}}
    assert spec_from_response_format(no_schema) == GrammarSpec("json_object")


@pytest.mark.parametrize("response_format, message", [
    ({"type": "yaml"}, "response_format.type must be"),
    ({"type": "json_schema"}, "must be an object with a name"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema: a JSON schema must be an object"),
    ("json", "response_format must be an object"),
])
def test_bad_response_format(response_format, message):
    with pytest.raises(ValueError, match=message):
        spec_from_request(response_format=response_format)


def test_structured_outputs_forms():
    as_dict = spec_from_structured_outputs({"json": SCHEMA})
    assert as_dict == spec_from_structured_outputs({"json": json.dumps(SCHEMA)})
    assert as_dict.whitespace == "spaced"
    assert spec_from_structured_outputs({"regex": "[0-9]+"}) == GrammarSpec("regex", "[0-9]+")
    choice = spec_from_structured_outputs({"choice": ["yes", "no"]})
    assert choice == GrammarSpec("choice", '["yes", "no"]')
    grammar = 'root ::= "a" | "b"'
    assert spec_from_structured_outputs({"grammar": grammar}) == GrammarSpec("grammar", grammar)
    assert spec_from_structured_outputs({"json_object": True}) == GrammarSpec("json_object")
    compact = spec_from_structured_outputs({"json": SCHEMA, "disable_any_whitespace": True})
    flexible = spec_from_structured_outputs({"json_object": True, "disable_any_whitespace": False})
    assert (compact.whitespace, flexible.whitespace) == ("compact", "flexible")
    # Unset fields may be sent as null or false, as vLLM's clients do.
    assert spec_from_structured_outputs({"regex": "a", "json": None, "json_object": False}).kind == "regex"


@pytest.mark.parametrize("params, message", [
    ({}, "exactly one of .* got none"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of .* got regex, choice"),
    ({"regex": "a", "structural_tag": "x"}, "does not support structural_tag"),
    ({"regex": 5}, "structured_outputs.regex must be a string"),
    ({"grammar": ""}, "the grammar must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "each choice must be a non-empty string"),
    ({"choice": "a"}, "choice must be a non-empty list"),
    ({"json": "{not json"}, "structured_outputs.json: the JSON schema is not valid JSON"),
    ({"json": 3}, "a JSON schema must be an object or a boolean"),
    ({"json_object": "yes"}, "must be true or absent"),
    ({"regex": "a", "disable_any_whitespace": "no"}, "disable_any_whitespace must be a boolean"),
    ([1], "structured_outputs must be an object"),
])
def test_bad_structured_outputs(params, message):
    with pytest.raises(ValueError, match=message):
        spec_from_request(structured_outputs=params)


def test_guided_fields_and_conflicts():
    assert spec_from_request() is None
    assert spec_from_request(guided_json=SCHEMA) == spec_from_structured_outputs({"json": SCHEMA})
    assert spec_from_request(guided_regex="a+") == GrammarSpec.regex("a+")
    assert spec_from_request(guided_choice=["x", "y"]) == GrammarSpec.choice(["x", "y"])
    assert spec_from_request(guided_grammar='start: "a"') == GrammarSpec.grammar('start: "a"')
    spec = GrammarSpec.regex("z")
    assert spec_from_request(structured_outputs=spec) is spec
    # A text response_format is no constraint, so it combines with one.
    assert spec_from_request(response_format={"type": "text"}, guided_regex="a") == GrammarSpec.regex("a")
    with pytest.raises(ValueError, match="one output constraint; got response_format, guided_regex"):
        spec_from_request(response_format={"type": "json_object"}, guided_regex="a")
    with pytest.raises(ValueError, match="got guided_json, guided_choice"):
        spec_from_request(guided_json=SCHEMA, guided_choice=["a"])
    with pytest.raises(ValueError, match="guided_regex must be a string"):
        spec_from_request(guided_regex=["a"])


def test_size_and_depth_bounds():
    limit = spec_module.MAX_SPEC_CHARS
    with pytest.raises(ValueError, match=f"the regex is {limit + 1} characters; the limit is {limit}"):
        GrammarSpec.regex("a" * (limit + 1))
    huge_enum = {"enum": ["x" * 100] * (limit // 100)}
    with pytest.raises(ValueError, match="the JSON schema is .* characters"):
        GrammarSpec.json_schema(huge_enum)
    with pytest.raises(ValueError, match="choice allows at most"):
        GrammarSpec.choice(["a"] * (spec_module.MAX_CHOICES + 1))
    deep = {"type": "string"}
    for _ in range(spec_module.MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper than"):
        GrammarSpec.json_schema(deep)
    # Far deeper than Python's recursion limit: still a clean ValueError, not a RecursionError.
    very_deep: dict = {}
    for _ in range(5000):
        very_deep = {"not": very_deep}
    with pytest.raises(ValueError, match="nests deeper than"):
        GrammarSpec.json_schema(very_deep)


@pytest.mark.parametrize("build", [
    lambda: GrammarSpec.regex("a{200000}"),
    lambda: GrammarSpec.regex("(ab){1, 5000}"),
    lambda: GrammarSpec.grammar('start: /x{20000}/'),
    lambda: GrammarSpec.json_schema({"type": "string", "pattern": "^a{100000}$"}),
    lambda: GrammarSpec.json_schema({"type": "object", "patternProperties": {"^b{5000}$": {}}}),
])
def test_large_counted_repetitions_are_refused(build):
    with pytest.raises(ValueError, match="counted repetitions are limited to 1000"):
        build()


def test_small_repetitions_and_escaped_braces_pass():
    assert GrammarSpec.regex("[0-9]{1,1000}").text == "[0-9]{1,1000}"
    assert GrammarSpec.regex(r"\{99999\}").kind == "regex"  # literal braces, not a repetition
    assert GrammarSpec.json_schema({"type": "string", "maxLength": 100000}).kind == "json_schema"


def test_specs_are_hashable_keys():
    a = GrammarSpec.json_schema(SCHEMA)
    b = GrammarSpec.json_schema(json.loads(json.dumps(SCHEMA)))
    assert a == b and hash(a) == hash(b) and len({a, b, GrammarSpec.json_object()}) == 2
    with pytest.raises(ValueError, match="whitespace must be"):
        GrammarSpec.json_schema(SCHEMA, whitespace="tabs")


@pytest.mark.parametrize("build", [
    lambda: GrammarSpec.regex("(a{1000}){400}"),  # issue 32, finding 3: 1.3 s masks a step
    lambda: GrammarSpec.regex("((a{10}){10}){11}"),
    lambda: GrammarSpec.regex("x(b|(c{50}d){3,21})"),
    lambda: GrammarSpec.json_schema({"type": "string", "pattern": "^(ab{40}){30}$"}),
])
def test_nested_counted_repetitions_are_bounded_by_their_product(build):
    with pytest.raises(ValueError, match="their product is limited to 1000"):
        build()


@pytest.mark.parametrize("pattern", ["(a{100}){10}", "(a{10}|b){20}", r"\(a{999}\){999}",
                                     "[(]{900}(x){900}", "(a{3})+(b{3})*", "[]a]{1000}"])
def test_nested_repetitions_within_the_product_pass(pattern):
    assert GrammarSpec.regex(pattern).text == pattern


def test_an_unknown_key_of_megabytes_is_not_echoed_whole():
    """Issue 32, finding 8: a 3 MB unknown key came back whole in the error."""
    with pytest.raises(ValueError) as info:
        spec_from_structured_outputs({"x" * 3_000_000: 1, "regex": "a"})
    assert len(str(info.value)) < 300 and "does not support xxx" in str(info.value)
