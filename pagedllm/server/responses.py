"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) over the chat path, as
server/anthropic.py does for Messages: the body becomes a chat completions body, the chat handler
runs it, and its answer becomes a Response, whole or as the Responses stream's typed events.

The mapping:
- instructions -> a system message; input (text, or items: messages with input_text/output_text
  parts, function_call and function_call_output items) -> messages, tool calls and tool messages;
- tools (flat function tools) and tool_choice -> the chat's; text.format json_schema/json_object ->
  response_format; max_output_tokens -> max_tokens; reasoning.effort "none" -> enable_thinking
  false in the template (other efforts: the template's default);
- reasoning_content -> a reasoning item, content -> a message item of output_text, tool_calls ->
  function_call items; finish "length" -> status incomplete (max_output_tokens).
previous_response_id continues a stored conversation: with store (the default) each response's
messages are kept in memory, the last MAX_STORED of them, for this process's life.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import Field

from pagedllm.server.chat_translation import chat_request
from pagedllm.server.protocol import APIError, ChatCompletionRequest, _Body

MAX_STORED = 1000


class ResponsesRequest(_Body):
    """Fields it does not declare (include, truncation, prompt_cache_key, ...) are logged by name
    as every body's are (protocol.ExtraFields), and have no effect."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


class ResponseStore:
    """The conversations of recent responses (their chat messages, answer included), by id."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        self._responses[response_id] = (messages, response)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def messages(self, response_id: str) -> list[dict]:
        return list(self._get(response_id)[0])

    def response(self, response_id: str) -> dict:
        return self._get(response_id)[1]

    def _get(self, response_id: str) -> tuple[list[dict], dict]:
        if response_id not in self._responses:
            raise APIError(f"no stored response {response_id!r} (responses are kept in memory, the "
                           f"last {self.capacity})", 404, param="previous_response_id", code="not_found")
        return self._responses[response_id]


def chat_messages(body: ResponsesRequest, store: ResponseStore) -> list[dict]:
    messages = store.messages(body.previous_response_id) if body.previous_response_id else []
    if body.instructions:  # instructions are not carried over from a previous response
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        messages += _item_messages(item, i)
    return messages


def _item_messages(item: dict, index: int) -> list[dict]:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(f"input.{index}.role must be user, assistant, system or developer; got {role!r}",
                           param="input")
        return [{"role": role, "content": _text_of(item.get("content"), index)}]
    if kind == "function_call":
        return [{"role": "assistant", "content": "", "tool_calls": [{
            "id": item.get("call_id") or item.get("id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}]}]
    if kind == "function_call_output":
        output = item.get("output")
        return [{"role": "tool", "tool_call_id": item.get("call_id"),
                 "content": output if isinstance(output, str) else json.dumps(output)}]
    if kind == "reasoning":
        return []  # earlier reasoning: the template thinks again
    raise APIError(f"input.{index}.type {kind!r} is not supported (message, function_call, "
                   "function_call_output, reasoning are)", param="input")


def _text_of(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"input.{index}.content must be text or a list of text parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(f"input.{index}.content part of type {kind!r} is not supported; only text "
                           "parts are", param="input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def chat_body(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
                              "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
                              "stream_options": {"include_usage": True} if body.stream else None,
                              "parallel_tool_calls": body.parallel_tool_calls, "user": body.user}
    if body.tools:
        fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}}
                                 if isinstance(choice, dict) else choice)
    text_format = (body.text or {}).get("format")
    if text_format and text_format.get("type") == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.get("name", "output"), "schema": text_format.get("schema", {}),
            "strict": text_format.get("strict")}}
    elif text_format and text_format.get("type") == "json_object":
        fields["response_format"] = {"type": "json_object"}
    if (body.reasoning or {}).get("effort") == "none":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    return chat_request(fields)


def _chat_tool(tool: dict, index: int) -> dict:
    if tool.get("type") != "function":
        raise APIError(f"tools.{index}.type {tool.get('type')!r} is not supported; only function tools are",
                       param="tools")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                 "strict") if tool.get(k) is not None}}


def response_object(response_id: str, chat: dict, body: ResponsesRequest) -> dict:
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    usage = chat.get("usage") or {}
    return _envelope(response_id, body, output, choice.get("finish_reason"), usage)


def _envelope(response_id: str, body: ResponsesRequest, output: list[dict], finish: str | None,
              usage: dict) -> dict:
    incomplete = finish == "length"
    return {
        "id": response_id, "object": "response", "created_at": time.time(), "model": body.model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "instructions": body.instructions, "output": output,
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False, "text": body.text,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "metadata": body.metadata or {},
        "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                  "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {})
                                           .get("cached_tokens", 0)},
                  "output_tokens": usage.get("completion_tokens", 0),
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage.get("total_tokens", 0)},
    }


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def stored_messages(messages: list[dict], response: dict) -> list[dict]:
    """The conversation a later previous_response_id continues: its messages and the answer."""
    answer: dict = {"role": "assistant", "content": ""}
    for item in response["output"]:
        if item["type"] == "message":
            answer["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            answer.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": function})
    return [*messages, answer]
