"""OpenAI's Responses API through the official openai client against a live server: the chat
path's answer as a Response, streamed and not, function calls and their outputs, a stored
conversation continued by previous_response_id, and bad input refused with a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_a_response_answers_as_chat_completions_does(server):
    c = client(server)
    response = c.responses.create(model=MODEL_NAME, input=QUESTION, instructions="Be brief.",
                                  max_output_tokens=20, temperature=0)
    chat = c.chat.completions.create(model=MODEL_NAME, max_tokens=20, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert c.responses.retrieve(response.id).output_text == response.output_text


def test_a_streamed_response_joins_to_the_whole_one(server):
    c = client(server)
    request = dict(model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text",
                                                                          "text": QUESTION}]}],
                   max_output_tokens=20, temperature=0)
    whole = c.responses.create(**request)
    events = list(c.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_function_calls_and_their_outputs(server):
    c = client(server)
    first = c.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER],
                               tool_choice={"type": "function", "name": "get_weather"},
                               max_output_tokens=64, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    streamed = list(c.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=64, temperature=0, stream=True))
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments
    follow = c.responses.create(model=MODEL_NAME, previous_response_id=first.id, tools=[WEATHER],
                                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                        "output": "sunny, 21 C"}], max_output_tokens=16, temperature=0)
    assert follow.output and follow.previous_response_id == first.id


def test_previous_response_id_continues_the_conversation(server):
    c = client(server)
    first = c.responses.create(model=MODEL_NAME, input="My name is Ada.", max_output_tokens=12, temperature=0)
    second = c.responses.create(model=MODEL_NAME, input="What is my name?", previous_response_id=first.id,
                                max_output_tokens=12, temperature=0)
    explicit = c.responses.create(model=MODEL_NAME, max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == explicit.output_text


@pytest.mark.parametrize("body, field, status", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", 400),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", 400),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", 400),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id", 404),
])
def test_bad_bodies_are_refused_naming_the_field(server, body, field, status):
    response = httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL_NAME, **body})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == field or field in response.json()["error"]["message"]
