"""What the grammar assumes where a schema is silent: objects that list properties are closed,
integers stay within 2^53 - 1, and nothing the schema says is overridden or made stricter where
that could refuse a valid instance."""

from __future__ import annotations

import pytest

from pagedllm.structured.schema import MAX_SAFE_INTEGER, grammar_schema
from pagedllm.structured.spec import GrammarSpec

POINT = {"type": "object", "properties": {"x": {"type": "number"}}}
CLOSED_POINT = {**POINT, "additionalProperties": False}


@pytest.mark.parametrize("schema, expected", [
    (POINT, CLOSED_POINT),
    ({"type": "array", "items": POINT}, {"type": "array", "items": CLOSED_POINT}),
    ({"properties": {"p": POINT}}, {"properties": {"p": CLOSED_POINT}, "additionalProperties": False}),
    ({"$defs": {"P": POINT}, "$ref": "#/$defs/P"}, {"$defs": {"P": CLOSED_POINT}, "$ref": "#/$defs/P"}),
    ({"anyOf": [POINT, {"type": "null"}]}, {"anyOf": [CLOSED_POINT, {"type": "null"}]}),
    # said otherwise, or open by nature: left alone
    ({**POINT, "additionalProperties": True}, {**POINT, "additionalProperties": True}),
    ({**POINT, "patternProperties": {"^y": {}}}, {**POINT, "patternProperties": {"^y": {}}}),
    ({"type": "object"}, {"type": "object"}),
    # parts of one object: closing one would refuse the others' properties
    ({"allOf": [POINT, {"properties": {"y": {}}}]}, {"allOf": [POINT, {"properties": {"y": {}}}]}),
    ({**POINT, "anyOf": [{"properties": {"y": {}}}]}, {**POINT, "anyOf": [{"properties": {"y": {}}}]}),
    ({"anyOf": [POINT], "allOf": [{"properties": {"y": {}}}]},
     {"anyOf": [POINT], "allOf": [{"properties": {"y": {}}}]}),
    # a property named like a keyword is a property, not a keyword
    ({"properties": {"properties": {"type": "string"}}},
     {"properties": {"properties": {"type": "string"}}, "additionalProperties": False}),
])
def test_objects_are_closed_where_the_schema_is_silent(schema, expected):
    assert grammar_schema(schema) == expected


@pytest.mark.parametrize("schema, expected", [
    ({"type": "integer"}, {"type": "integer", "minimum": -MAX_SAFE_INTEGER, "maximum": MAX_SAFE_INTEGER}),
    ({"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 0, "maximum": MAX_SAFE_INTEGER}),
    ({"type": "integer", "exclusiveMaximum": 5},
     {"type": "integer", "exclusiveMaximum": 5, "minimum": -MAX_SAFE_INTEGER}),
    ({"type": "integer", "minimum": 10**20}, {"type": "integer", "minimum": 10**20}),  # asks for big ones
    ({"type": "number"}, {"type": "number"}),
])
def test_integers_are_bounded_where_the_schema_is_silent(schema, expected):
    assert grammar_schema(schema) == expected


def test_the_schema_given_is_not_changed():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    grammar_schema(schema)
    assert schema == {"type": "object", "properties": {"n": {"type": "integer"}}}


def test_the_grammar_follows_the_assumptions(tiny_compiler, tiny_tokenizer):
    def accepts(schema: dict, text: str) -> bool:
        matcher = tiny_compiler.matcher(GrammarSpec.json_schema(schema))
        tokens = tiny_tokenizer.encode(text, add_special_tokens=False)
        return matcher.accept_tokens(tokens) and matcher.can_end

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert accepts(schema, '{"n": 9007199254740991}')
    assert not accepts(schema, '{"n": 9007199254740992}')
    assert not accepts(schema, '{"n": 1, "m": 2}')
    assert accepts({**schema, "additionalProperties": True}, '{"n": 1, "m": 2}')
