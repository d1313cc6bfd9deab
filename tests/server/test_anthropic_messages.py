"""Anthropic's Messages API through the official anthropic client against a live server: the same
answer as chat completions, streamed and not, tool use, and bad bodies refused with a 400."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME

SYSTEM = "You are a concise assistant."
QUESTION = "What is the capital of France?"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


# The 2026 SDK no longer names temperature; the API (and this server) still take it.
GREEDY = {"temperature": 0}


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def test_a_message_answers_as_chat_completions_does(server):
    answer = client(server).messages.create(
        model=MODEL_NAME, max_tokens=24, system=SYSTEM, extra_body=GREEDY,
        messages=[{"role": "user", "content": QUESTION}])
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    expected = chat.chat.completions.create(
        model=MODEL_NAME, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert answer.type == "message" and answer.role == "assistant"
    assert [block.type for block in answer.content] == ["text"]
    assert answer.content[0].text == expected.choices[0].message.content
    stop_reasons = {"stop": "end_turn", "length": "max_tokens"}
    assert answer.stop_reason == stop_reasons[expected.choices[0].finish_reason]
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    assert answer.usage.output_tokens == expected.usage.completion_tokens


def test_a_streamed_message_joins_to_the_whole_one(server):
    request = dict(model=MODEL_NAME, max_tokens=24, extra_body=GREEDY,
                   messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    whole = client(server).messages.create(**request)
    kinds, text = [], []
    with client(server).messages.stream(**request) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text.append(event.delta.text)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert "".join(text) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_use_and_its_result_in_the_next_turn(server):
    c = client(server)
    first = c.messages.create(model=MODEL_NAME, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                              tool_choice={"type": "tool", "name": "get_weather"},
                              messages=[{"role": "user", "content": "Weather in Paris?"}])
    calls = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name == "get_weather" and isinstance(calls[0].input.get("city"), str)
    second = c.messages.create(model=MODEL_NAME, max_tokens=16, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                      "content": "sunny, 21 C"}]}])
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with c.messages.stream(model=MODEL_NAME, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                           tool_choice={"type": "tool", "name": "get_weather"},
                           messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(calls[0].name, calls[0].input)]


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     "messages"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
])
def test_bad_bodies_are_a_400_naming_the_field(server, body, field):
    response = httpx.post(f"{server.base_url}/v1/messages", json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


def test_output_config_holds_the_text_to_a_json_schema(server):
    import json

    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    answer = client(server).messages.create(
        model=MODEL_NAME, max_tokens=48, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": QUESTION}])
    assert isinstance(json.loads(answer.content[0].text)["capital"], str)
