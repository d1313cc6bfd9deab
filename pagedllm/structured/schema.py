"""What the grammar assumes where a JSON schema is silent.

JSON Schema leaves a lot open by default: an object may have any properties besides those it
lists, an integer any number of digits. A person writing JSON never uses that freedom by
accident; a small model does, and keeps going until max_tokens cuts it off, which leaves JSON that
does not parse. SmolLM2-135M did both on most schemas we tried: it invented key after key
("population_density_per_square_mile", ...) and wrote "population": 1111111... So the grammar is
built from a copy of the schema with two defaults, each applying only where the schema says
nothing, and each keeping every output valid against the schema as given:

- an object that lists properties takes no others ("additionalProperties": false), as OpenAI's
  strict mode requires, xgrammar's strict mode (vLLM's default backend) assumes and vLLM offers
  for llguidance ("disable_additional_properties");
- an integer lies within +-(2^53 - 1), the integers every JSON parser reads exactly (JavaScript's
  safe integers; parsers that read numbers as doubles round past them).

Left open, so that no valid instance is refused: objects that combine their properties with
subschemas that may add more (allOf, anyOf, oneOf, $ref, if), and subschemas that are parts of
one object: allOf's, or alternatives beside other parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_SAFE_INTEGER = 2**53 - 1

# Where a schema holds subschemas: one, a list of them, or a map of names to them.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COMBINATIONS = ("allOf", "anyOf", "oneOf")
# Subschemas that may add properties to the object beside them.
_PART_KEYS = (*_COMBINATIONS, "$ref", "if")
# An object with one of these may take properties besides those it lists: it stays as it is.
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", *_PART_KEYS)


def grammar_schema(schema: Any, whole_object: bool = True) -> Any:
    """A copy of schema with the defaults above. whole_object: False for a subschema that is
    only a part of its object (it must not be closed)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), Mapping):
            out[key] = grammar_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [grammar_schema(sub) for sub in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: grammar_schema(sub) for name, sub in out[key].items()}
    lists_properties = isinstance(out.get("properties"), Mapping) and bool(out["properties"])
    # anyOf / oneOf alternatives are whole objects, unless something beside them adds parts.
    alternatives_whole = not lists_properties and sum(key in out for key in _PART_KEYS) == 1
    for key in _COMBINATIONS:
        if isinstance(out.get(key), list):
            out[key] = [grammar_schema(sub, key != "allOf" and alternatives_whole) for sub in out[key]]
    if whole_object and lists_properties and not any(key in out for key in _OPEN_KEYS):
        out["additionalProperties"] = False
    if out.get("type") == "integer":
        _bound_integer(out)
    return out


def _bound_integer(schema: dict) -> None:
    """The safe range on each side the schema leaves open (unless its other bound lies beyond:
    then the schema asks for big integers and gets them)."""
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if low is None and (not _is_number(high) or high > -MAX_SAFE_INTEGER):
        schema["minimum"] = -MAX_SAFE_INTEGER
    if high is None and (not _is_number(low) or low < MAX_SAFE_INTEGER):
        schema["maximum"] = MAX_SAFE_INTEGER


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
