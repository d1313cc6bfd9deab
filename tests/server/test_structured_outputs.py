"""Structured outputs and tool calling through the official openai client, with the default model
(SmolLM2-135M, which rarely writes valid JSON unconstrained): JSON schemas, json_object, choices,
regexes, forced and parsed tool calls, pydantic parsing, streaming, and the 400s for bad input.

Requests of one test go out together (AsyncOpenAI), so they share batches as real traffic does."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from pagedllm.structured.compiler import GrammarCompiler
from tests.server.conftest import MODEL_NAME


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def together(server, calls):
    """Run calls(async_client) -> list of awaitables concurrently; their results."""
    async def run():
        ac = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*calls(ac))
        finally:
            await ac.close()

    return asyncio.run(run())


def _object(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **extra}


STRING = {"type": "string"}
SHORT_TEXT = {"type": "string", "maxLength": 120}
# Twenty schemas a user might send, each with the request that asks for it: nested objects,
# arrays, enums, required fields, numbers with bounds, patterns. Free text that a small model
# may never end carries a maxLength, as a schema for a real application would.
SCHEMAS = [
    ("A fictional person: name, age and email.",
     _object({"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": STRING})),
    ("A book: title, author and year published.",
     _object({"title": STRING, "author": STRING,
              "year": {"type": "integer", "minimum": 1400, "maximum": 2025}})),
    ("The weather in Paris today.",
     _object({"city": STRING, "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
              "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}})),
    ("A product in a shop with its price.",
     _object({"name": STRING, "price": {"type": "number", "exclusiveMinimum": 0},
              "in_stock": {"type": "boolean"}})),
    ("A movie review with a rating from 1 to 5.",
     _object({"movie": STRING, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
              "summary": SHORT_TEXT})),
    ("A shopping list of up to five items.",
     _object({"items": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 5}})),
    ("A person with their home address.",
     _object({"name": STRING, "address": _object({
         "street": STRING, "city": STRING, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("The sentiment of: 'I love this phone'.",
     _object({"sentiment": {"enum": ["positive", "negative", "neutral"]},
              "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("A recipe with its ingredients.",
     _object({"dish": STRING, "ingredients": {
         "type": "array", "minItems": 1, "maxItems": 4,
         "items": _object({"name": STRING, "grams": {"type": "integer", "minimum": 1, "maximum": 1000}})}})),
    ("A country and its capital.",
     _object({"country": STRING, "capital": STRING, "continent": {
         "enum": ["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]}})),
    ("A user account.",
     _object({"username": {"type": "string", "pattern": "^[a-z]{3,12}$"},
              "is_admin": {"type": "boolean"}, "login_count": {"type": "integer", "minimum": 0}})),
    ("A point in 3D space.",
     _object({"x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "number"}})),
    ("A task in a to-do list.",
     _object({"title": STRING, "priority": {"enum": ["low", "medium", "high"]},
              "done": {"type": "boolean"}, "tags": {"type": "array", "items": STRING, "maxItems": 3}})),
    ("A company with two employees.",
     _object({"company": STRING, "employees": {
         "type": "array", "items": _object({"name": STRING, "role": STRING}),
         "minItems": 2, "maxItems": 2}})),
    ("An order with an id and a total.",
     _object({"order_id": {"type": "integer", "minimum": 1},
              "total": {"type": "number", "minimum": 0, "maximum": 10000},
              "currency": {"enum": ["USD", "EUR", "GBP"]}})),
    ("A color in RGB.",
     _object({"name": STRING, "rgb": {"type": "array", "minItems": 3, "maxItems": 3,
                                      "items": {"type": "integer", "minimum": 0, "maximum": 255}}})),
    ("An event with a date.",
     _object({"event": {"type": "string", "maxLength": 40},
              "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
              "attendees": {"type": "integer", "minimum": 0, "maximum": 100000}})),
    ("A planet of the solar system.",
     _object({"planet": {"enum": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn",
                                  "Uranus", "Neptune"]},
              "moons": {"type": "integer", "minimum": 0, "maximum": 200}, "has_rings": {"type": "boolean"}})),
    ("A student with grades.",
     _object({"student": STRING, "grades": _object({
         "math": {"type": "integer", "minimum": 0, "maximum": 100},
         "english": {"type": "integer", "minimum": 0, "maximum": 100}})})),
    ("A flight between two cities.",
     _object({"from": STRING, "to": STRING, "nonstop": {"type": "boolean"},
              "duration_hours": {"type": "number", "minimum": 0.5, "maximum": 20}},
             required=["from", "to", "nonstop"])),
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": _object({"city": STRING, "unit": {"enum": ["celsius", "fahrenheit"]}})}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": _object({"timezone": {"type": "string", "maxLength": 40}})}}
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert an amount between currencies",
    "parameters": _object({"amount": {"type": "number", "minimum": 0},
                           "from": {"enum": ["USD", "EUR", "GBP"]}, "to": {"enum": ["USD", "EUR", "GBP"]}})}}
TOOLS = [WEATHER, TIME, CONVERT]
TOOL_QUESTIONS = ["What is the weather in Paris?", "What time is it in Tokyo?",
                  "How much is 20 dollars in euros?"]


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _check_call(call, tools=TOOLS) -> dict:
    """A tool call's arguments, checked: a known function, arguments valid for its parameters."""
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, parameters[call.function.name])
    return arguments


def test_twenty_json_schemas_all_validate(server):
    responses = together(server, lambda ac: [
        ac.chat.completions.create(
            model=MODEL_NAME, messages=_chat(f"{request} Answer in JSON."), temperature=0,
            max_tokens=300, response_format={"type": "json_schema", "json_schema": {
                "name": f"case_{i}", "schema": schema, "strict": True}})
        for i, (request, schema) in enumerate(SCHEMAS)])
    for (request, schema), response in zip(SCHEMAS, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (request, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_parses(server):
    """Greedy answers all end and parse. Sampled ones parse whenever they end by themselves; the
    grammar cannot make a model stop (at temperature 1 SmolLM2 sometimes writes a number or a
    string until max_tokens), so one cut by max_tokens says "length"."""
    questions = ["Describe a cat as a JSON object.", "Give the name and age of a fictional person in JSON.",
                 "Return a JSON object with the keys city and country for Paris.",
                 "What is 2 + 2? Reply with a JSON object.", "Create a JSON object for a book."]
    responses = together(server, lambda ac: [
        ac.chat.completions.create(model=MODEL_NAME, messages=_chat(q), max_tokens=300,
                                   temperature=temperature, seed=7,
                                   response_format={"type": "json_object"})
        for temperature in (0, 1) for q in questions])
    for i, response in enumerate(responses):
        choice = response.choices[0]
        if i < len(questions) or choice.finish_reason == "stop":
            assert choice.finish_reason == "stop"
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and response.usage.completion_tokens == 300


def test_choice_regex_and_grammar_in_every_spelling(server):
    c = client(server)
    colors = ["red", "green", "blue"]
    for extra in ({"structured_outputs": {"choice": colors}}, {"guided_choice": colors}):
        for temperature in (0, 1):
            chat = c.chat.completions.create(model=MODEL_NAME, messages=_chat("Name a color."),
                                             temperature=temperature, max_tokens=10, extra_body=extra)
            assert chat.choices[0].message.content in colors
            text = c.completions.create(model=MODEL_NAME, prompt="My favourite color is", n=3,
                                        temperature=temperature, max_tokens=10, extra_body=extra)
            assert all(choice.text in colors for choice in text.choices)
    with_logprobs = c.chat.completions.create(
        model=MODEL_NAME, messages=_chat("Name a color."), max_tokens=10, logprobs=True, top_logprobs=5,
        extra_body={"guided_choice": colors})
    assert with_logprobs.choices[0].message.content in colors
    for token in with_logprobs.choices[0].logprobs.content:  # forbidden tokens are no alternatives
        assert all(alt.logprob > -1e9 for alt in token.top_logprobs) and token.logprob > -1e9
    phone = c.completions.create(model=MODEL_NAME, prompt="Call me at", max_tokens=20, temperature=0,
                                 extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert phone.choices[0].text[3] == "-" and phone.choices[0].text.replace("-", "").isdigit()
    answer = c.completions.create(model=MODEL_NAME, prompt="Is the sky blue?", max_tokens=5,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert answer.choices[0].text in ("yes", "no")
    schema = _object({"ok": {"type": "boolean"}})
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        out = c.completions.create(model=MODEL_NAME, prompt="Status:", max_tokens=20, extra_body=extra)
        jsonschema.validate(json.loads(out.choices[0].text), schema)


@pytest.mark.timeout(600)  # 91 s on the 2-core machine under load: the slowest test
def test_a_forced_call_cut_by_max_tokens_is_no_call(server):
    """max_tokens 1 leaves a forced call unfinished: no tool_calls and empty content, as OpenAI
    and vLLM answer (a named function's half-written arguments once came back as its call)."""
    named = {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}}
    for choice in ("required", named):
        response = client(server).chat.completions.create(
            model=MODEL_NAME, messages=_chat(TOOL_QUESTIONS[0]), tools=TOOLS, tool_choice=choice,
            max_completion_tokens=1, temperature=0)
        answer = response.choices[0]
        assert answer.finish_reason == "length" and answer.message.tool_calls is None, choice
        assert not answer.message.content


def test_named_and_required_tool_choices_give_valid_calls(server):
    """A named function: one call of it. "required" with parallel_tool_calls false: one call of
    any tool. Each always complete and valid for its tool's parameters. With parallel calls the
    model may go on calling until max_tokens (SmolLM2 often does): the calls it finished are
    valid, and only a cut one at the end is not."""
    named = [{"type": "function", "function": {"name": tool["function"]["name"]}} for tool in TOOLS]
    cases = [(q, choice, parallel, temperature) for q in TOOL_QUESTIONS for temperature in (0, 1)
             for choice, parallel in [("required", False), ("required", True), *((n, True) for n in named)]]
    responses = together(server, lambda ac: [
        ac.chat.completions.create(model=MODEL_NAME, messages=_chat(q), tools=TOOLS, tool_choice=choice,
                                   parallel_tool_calls=parallel, max_tokens=200, temperature=temperature,
                                   seed=11)
        for q, choice, parallel, temperature in cases])
    for case, response in zip(cases, responses):
        _, choice, parallel, _ = case
        finish, message = response.choices[0].finish_reason, response.choices[0].message
        calls = message.tool_calls
        assert calls and (message.content is None or finish == "length"), (case, message)
        if choice != "required":
            assert finish == "stop"
            assert [call.function.name for call in calls] == [choice["function"]["name"]]
        elif not parallel:
            assert finish == "tool_calls" and len(calls) == 1
        else:
            assert finish in ("tool_calls", "length")
            calls = calls[:-1] if finish == "length" else calls
        for call in calls:
            _check_call(call)


def test_auto_tool_calls_are_parsed_whole_and_streamed(server):
    """The default model's template has no tools section: tools go into the system message and
    calls are read in Hermes' format. A regex makes the model write a call, so the parsing is
    what is tested."""
    c = client(server)
    written = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
               '\n</tool_call>')
    regex = r"Let me check\.\n" + _escape(written)
    kwargs = dict(model=MODEL_NAME, messages=_chat("Weather in Paris?"), tools=TOOLS, max_tokens=60,
                  temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    whole = c.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert _check_call(call) == {"city": "Paris", "unit": "celsius"}
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments
    none = c.chat.completions.create(**{**kwargs, "tool_choice": "none"})
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}" else ch for ch in text)


def test_tool_history_reaches_the_model(server):
    """An assistant's tool calls and the tool's answer in the history: the model answers from it."""
    c = client(server)
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "condition": "sunny"}'},
    ]
    answer = c.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=40,
                                       temperature=0, tool_choice="none")
    assert answer.choices[0].message.content
    usage_with_tools = answer.usage.prompt_tokens
    plain = c.chat.completions.create(model=MODEL_NAME, messages=history[:1], max_tokens=1)
    assert usage_with_tools > plain.usage.prompt_tokens + 20  # the call and its result were in the prompt


class City(BaseModel):
    city: str
    country: str
    population: int


def test_pydantic_parse(server):
    parsed = client(server).beta.chat.completions.parse(
        model=MODEL_NAME, messages=_chat("Describe Paris: city, country and population."),
        response_format=City, temperature=0, max_tokens=100)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.city


def test_streaming_gives_the_same_text(server):
    c = client(server)
    for request, schema in SCHEMAS[:3]:
        kwargs = dict(model=MODEL_NAME, messages=_chat(request), temperature=0, max_tokens=200,
                      response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        whole = c.chat.completions.create(**kwargs).choices[0].message.content
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in c.chat.completions.create(**kwargs, stream=True) if chunk.choices)
        assert streamed == whole
        jsonschema.validate(json.loads(streamed), schema)


@pytest.mark.parametrize("endpoint,body,param,words", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "zero"}}}}}},
     "response_format", "invalid json schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ("completions", {"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ("completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("chat", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex", "one output constraint"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
     "tool_choice", "'launch', which is not in tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "frobnicate"}}}}}]}, "tools", "tool 'f'"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools", "must describe an object"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools", "used twice"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "at least one tool"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "send one of them"),
])
def test_bad_input_is_a_400_naming_the_problem(server, endpoint, body, param, words):
    base = {"messages": _chat("hi")} if endpoint == "chat" else {"prompt": "hi"}
    path = "chat/completions" if endpoint == "chat" else "completions"
    response = httpx.post(f"{server.base_url}/v1/{path}", json={**base, **body, "max_tokens": 5}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param, error


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "array", "items": schema}, {"type": "null"}]}
    return schema


@pytest.mark.parametrize("schema,words", [
    (_nested(40), "nests deeper than"),
    ({"enum": [f"value number {i} " + "z" * 60 for i in range(1000)]}, "the limit is"),
])
def test_pathological_schema_is_a_quick_400(server, schema, words, monkeypatch):
    """Bounded before anything is built (nesting, size; pagedllm.structured.spec): no grammar is
    compiled for it; the server serves on."""
    compiled = []
    real_submit = GrammarCompiler.submit
    monkeypatch.setattr(GrammarCompiler, "submit", lambda self, spec: compiled.append(spec) or
                        real_submit(self, spec))
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": _chat("hi"), "max_tokens": 5, "structured_outputs": {"json": schema}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs"
    assert words in response.json()["error"]["message"]
    assert compiled == []
    assert httpx.get(f"{server.base_url}/health").status_code == 200
