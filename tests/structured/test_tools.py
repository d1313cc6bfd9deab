"""Tools: validation that names the tool, tool_choice against the tools, the schema that forces
valid calls (random constrained walks always parse into calls whose arguments validate), and the
fallback prompt for templates without a tools section."""

import copy
import json
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.structured.tool_parsers import NamedToolParser, make_parser, parse_tool_calls
from pagedllm.structured.tools import (
    Tool,
    ToolChoice,
    messages_with_tools_prompt,
    parse_tool_choice,
    parse_tools,
    template_has_tools,
    tool_call_spec,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["utc_offset"], "additionalProperties": False}}}
QWEN_LIKE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "<tool_call>...</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}")


def tool_with(parameters, name="f"):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_parse_tools():
    tools = parse_tools([WEATHER, TIME, {"type": "function", "function": {"name": "noargs"}}])
    assert [t.name for t in tools] == ["get_weather", "get_time", "noargs"]
    assert tools[0].description == "Current weather in a city"
    assert tools[2].parameters == {"type": "object", "properties": {}}
    assert tools[0].to_openai() == WEATHER


@pytest.mark.parametrize("tools, message", [
    ({"type": "function"}, "tools must be a list"),
    ([{"type": "retrieval"}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "has space"}}], r"tools\[0\].function.name must be"),
    ([WEATHER, WEATHER], "the name 'get_weather' is used twice"),
    ([tool_with([1])], "tool 'f': parameters must be a JSON schema object"),
    ([tool_with({"type": "string"})], "tool 'f': parameters must describe an object"),
    ([tool_with({"type": "object", "properties": {"x": {"type": "strng"}}})],
     "tool 'f': parameters is not a usable JSON schema: invalid json schema: Invalid type: strng"),
    ([tool_with({"type": "object", "properties": []})], "tool 'f': .*properties must be an object"),
    ([tool_with({"type": "object", "properties": {"x": {"pattern": "a{9999}"}}})],
     "tool 'f': .*counted repetitions are limited"),
    ([{"type": "function", "function": {"name": "g", "description": 3}}], "tool 'g': description"),
])
def test_bad_tools_name_the_problem(tools, message):
    with pytest.raises(ValueError, match=message):
        parse_tools(tools)


def test_tool_choice():
    tools = parse_tools([WEATHER, TIME])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, tools) == ToolChoice("named", "get_time")
    unknown = r"names the function 'nope', which is not in tools \(get_weather, get_time\)"
    with pytest.raises(ValueError, match=unknown):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(ValueError) as huge:  # a megabyte of name is not echoed back whole
        parse_tool_choice({"type": "function", "function": {"name": "x" * 2**20}}, tools)
    assert "'" + "x" * 64 + "'... (1048576 characters)" in str(huge.value) and len(str(huge.value)) < 300
    with pytest.raises(ValueError, match="'required' needs at least one tool"):
        parse_tool_choice("required", [])
    for bad in ("any", {"type": "function"}, {"function": {"name": "get_time"}}, 3):
        with pytest.raises(ValueError, match="tool_choice must be"):
            parse_tool_choice(bad, tools)


def test_tool_call_spec_shapes():
    tools = parse_tools([WEATHER, TIME])
    assert tool_call_spec(tools, ToolChoice("auto")) is None
    assert tool_call_spec(tools, ToolChoice("none")) is None
    named = tool_call_spec(tools, ToolChoice("named", "get_time"))
    assert json.loads(named.text) == TIME["function"]["parameters"]
    required = json.loads(tool_call_spec(tools, ToolChoice("required")).text)
    assert required["minItems"] == 1 and "maxItems" not in required
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    single = json.loads(tool_call_spec(tools[:1], ToolChoice("required"), parallel_tool_calls=False).text)
    assert single["maxItems"] == 1 and single["items"]["properties"]["name"] == {"const": "get_weather"}


def _constrained_walk(compiler, tokenizer, spec, seed) -> str:
    """Uniformly random tokens from each mask, EOS as soon as it is allowed. (Drawing each token
    from hypothesis would favour the first allowed id, "," before "]", and never end an array.)"""
    rng = random.Random(seed)
    matcher = compiler.matcher(spec)
    tokens = []
    for _ in range(400):
        if matcher.can_end:
            break
        token = rng.choice(matcher.allowed_token_ids())
        assert matcher.accept_token(token)
        tokens.append(token)
    assert matcher.can_end
    return tokenizer.decode(tokens)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), parallel=st.booleans())
def test_forced_tool_choices_always_give_valid_calls(smol_compiler, smol_tokenizer, seed, parallel):
    tools = parse_tools([WEATHER, TIME])
    by_name = {t.name: t for t in tools}
    required = tool_call_spec(tools, ToolChoice("required"), parallel_tool_calls=parallel)
    text = _constrained_walk(smol_compiler, smol_tokenizer, required, seed)
    message = parse_tool_calls(text, make_parser("json"))
    assert message.content is None and 1 <= len(message.tool_calls) <= (100 if parallel else 1)
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.arguments), by_name[call.name].parameters)

    named = tool_call_spec(tools, ToolChoice("named", "get_weather"))
    text = _constrained_walk(smol_compiler, smol_tokenizer, named, seed)
    (call,) = parse_tool_calls(text, NamedToolParser("get_weather")).tool_calls
    assert call.name == "get_weather" and call.arguments == text
    jsonschema.validate(json.loads(call.arguments), by_name["get_weather"].parameters)


def test_template_has_tools(smol_tokenizer):
    assert not template_has_tools(smol_tokenizer.chat_template)
    assert template_has_tools(QWEN_LIKE_TEMPLATE)
    assert not template_has_tools(None) and not template_has_tools("{% if %}")


def test_fallback_prompt_and_history_render_through_smollm2(smol_tokenizer):
    tools = parse_tools([WEATHER])
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    original = copy.deepcopy(messages)
    rewritten = messages_with_tools_prompt(messages, tools)
    assert messages == original  # the caller's list is left alone
    assert rewritten[0]["role"] == "system" and "<tools>\n" + json.dumps(WEATHER) in rewritten[0]["content"]
    assert rewritten[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                            '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'}
    assert rewritten[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    prompt = smol_tokenizer.apply_chat_template(rewritten)
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")

    with_system = messages_with_tools_prompt([{"role": "system", "content": "Be brief."}], tools)
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools") and len(with_system) == 1
    assert messages_with_tools_prompt(messages[:1], []) == messages[:1]


def test_tool_round_trip_through_openai_shape():
    tool = Tool("f", {"type": "object"}, None)
    assert tool.to_openai() == {"type": "function",
                                "function": {"name": "f", "parameters": {"type": "object"}}}


# Tools whose parameters use definitions: two define "Place" differently, one refers to its own
# root (a recursive tree, bounded by maxItems so that walks end).
ROUTE = {"type": "function", "function": {"name": "route", "parameters": {
    "type": "object", "$defs": {"Place": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6}}, "required": ["city"], "additionalProperties": False}},
    "properties": {"from": {"$ref": "#/$defs/Place"}, "to": {"$ref": "#/$defs/Place"}},
    "required": ["from", "to"], "additionalProperties": False}}}
LOCATE = {"type": "function", "function": {"name": "locate", "parameters": {
    "type": "object", "definitions": {"Place": {"enum": ["home", "work"]}},
    "properties": {"where": {"$ref": "#/definitions/Place"}}, "required": ["where"],
    "additionalProperties": False}}}
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"leaf": {"type": "boolean"},
                                     "children": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}},
    "required": ["leaf"], "additionalProperties": False}}}


def test_required_tool_choice_keeps_the_tools_definitions_working():
    """Each tool's $defs/definitions move to the root of the array's schema, renamed where two
    tools define one name differently; a ref to a tool's own root points at a copy of it."""
    required = json.loads(tool_call_spec(parse_tools([ROUTE, LOCATE, TREE]), ToolChoice("required")).text)
    route, locate, tree = (call["properties"]["parameters"] for call in required["items"]["anyOf"])
    assert route["properties"]["from"] == {"$ref": "#/$defs/Place"}
    assert locate["properties"]["where"] == {"$ref": "#/$defs/locate.Place"}
    assert required["$defs"]["Place"] == ROUTE["function"]["parameters"]["$defs"]["Place"]
    assert required["$defs"]["locate.Place"] == {"enum": ["home", "work"]}
    assert tree["properties"]["children"]["items"] == {"$ref": "#/$defs/parameters"}
    assert required["$defs"]["parameters"] == tree
    # The tools' own schemas are left as they were.
    assert parse_tools([ROUTE])[0].parameters == ROUTE["function"]["parameters"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32))
def test_required_calls_with_definitions_validate_against_each_tools_schema(smol_compiler, smol_tokenizer,
                                                                            seed):
    tools = parse_tools([ROUTE, LOCATE, TREE])
    by_name = {t.name: t for t in tools}
    text = _constrained_walk(smol_compiler, smol_tokenizer, tool_call_spec(tools, ToolChoice("required")),
                             seed)
    message = parse_tool_calls(text, make_parser("json"))
    assert message.tool_calls
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.arguments), by_name[call.name].parameters)
