"""Anthropic's Messages API (POST /v1/messages) over the chat completions path: a Messages body is
translated into a chat completions body, run by the same handler (templates, tools, structured
outputs, limits, aborts), and its answer translated back, whole or as Anthropic's SSE events.

Translating at the edges keeps one generation path: what chat completions does, Messages does,
and the translation is the only code here. The mapping:
- system (text or text blocks) -> a system message; text blocks -> content; an assistant's
  tool_use blocks -> tool_calls; a user's tool_result blocks -> tool messages; thinking blocks in
  the history are dropped (the template re-thinks); image and document blocks -> a 400;
- tools {name, description, input_schema} -> functions; tool_choice auto/any/tool/none ->
  auto/required/{function}/none; stop_sequences -> stop; thinking enabled/adaptive ->
  chat_template_kwargs enable_thinking (disabled -> false), budget_tokens -> thinking_token_budget
  (which needs --reasoning-parser); output_config.format's JSON schema ->
  response_format (effort has no meaning here: accepted, no effect);
- the answer's reasoning_content -> a thinking block, content -> a text block, tool_calls ->
  tool_use blocks; finish reasons stop/length/tool_calls -> end_turn (stop_sequence when a stop
  string matched)/max_tokens/tool_use; usage -> input_tokens/output_tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.server.chat_translation import chat_chunks, chat_request
from pagedllm.server.formats import sse_json
from pagedllm.server.protocol import APIError, ChatCompletionRequest

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "abort": "end_turn"}


class _Block(BaseModel):
    # Fields newer SDKs add to a block they echo back (caller, toolset_name, ...) carry nothing a
    # conversation needs here: taken and left. An unknown block *type* is a 400 (the union's tag).
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Block):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Block):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Block):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Block):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Anthropic's platform fields, with nothing to do on one server: accepted, no effect (prompt
    # caching is automatic here: the prefix cache).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def chat_body(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completions body that asks for what the Messages body asks for."""
    messages: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages += _chat_messages(message, i)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "stop": body.stop_sequences, "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
        if body.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
        if body.thinking.type == "enabled" and body.thinking.budget_tokens is not None:
            # The reasoning parser's budget (server/reasoning.py): without --reasoning-parser, a 400.
            fields["thinking_token_budget"] = body.thinking.budget_tokens
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    return chat_request(fields)


def _chat_messages(message: Message, index: int) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text, calls, results = [], [], []
    for block in message.content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise APIError(f"messages.{index}: tool_use blocks belong to assistant messages",
                               param="messages")
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise APIError(f"messages.{index}: tool_result blocks belong to user messages",
                               param="messages")
            content = block.content if isinstance(block.content, str) or block.content is None \
                else "".join(b.text for b in block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""})
    out = list(results)
    if text or calls or not results:
        chat: dict = {"role": message.role, "content": "".join(text)}
        if calls:
            chat["tool_calls"] = calls
        out.append(chat)
    return out


def _tool_choice(choice: ToolChoice):
    if choice.type == "tool":
        if not choice.name:
            raise APIError("tool_choice of type tool needs a name", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def message_response(chat: dict, model: str) -> dict:
    """A whole chat completion as a Messages answer."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    stop_reason, stop_sequence = _stop(choice)
    if message.get("tool_calls"):  # a named tool_choice finishes with "stop" in OpenAI's shape
        stop_reason = "tool_use"
    usage = chat.get("usage") or {}
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                      "output_tokens": usage.get("completion_tokens", 0)}}


def _stop(choice: dict) -> tuple[str | None, str | None]:
    reason, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP_REASONS.get(reason, reason), None


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {sse_json({'type': kind, **payload})}\n\n"


class _StreamTranslator:
    """Chat completion chunks in, Anthropic's events out: one content block at a time, opened on
    its first delta and closed when another kind starts or the answer ends."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.stop: tuple[str | None, str | None] = (None, None)
        self.used_tools = False
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    def start(self) -> str:
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": dict(self.usage)}
        return _event("message_start", {"message": message})

    def chunk(self, chunk: dict) -> list[str]:
        events: list[str] = []
        if chunk.get("usage"):
            self.usage = {"input_tokens": chunk["usage"].get("prompt_tokens", 0),
                          "output_tokens": chunk["usage"].get("completion_tokens", 0)}
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                events += self._block("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):  # a new call: a block of its own
                    self.used_tools = True
                    events += self._close()
                    events += self._block("tool_use", {"type": "tool_use", "id": call["id"],
                                                       "name": function.get("name", ""), "input": {}})
                if function.get("arguments"):
                    events.append(self._delta({"type": "input_json_delta",
                                               "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self.stop = _stop(choice)
        return events

    def finish(self) -> list[str]:
        reason, sequence = ("tool_use", None) if self.used_tools else self.stop
        return [*self._close(),
                _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": {"output_tokens": self.usage["output_tokens"]}}),
                _event("message_stop", {})]

    def _block(self, kind: str, content_block: dict) -> list[str]:
        if self.open == kind and kind != "tool_use":
            return []
        events = self._close()
        self.index += 1
        self.open = kind
        return [*events, _event("content_block_start", {"index": self.index, "content_block": content_block})]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


async def _translate_stream(chunks: AsyncIterator, model: str) -> AsyncIterator[str]:
    translator = _StreamTranslator(model)
    yield translator.start()
    async for chunk in chat_chunks(chunks):
        if "error" in chunk:
            error = chunk["error"]
            yield _event("error", {"error": {"type": error.get("type", "api_error"),
                                             "message": error.get("message", "")}})
            return
        for event in translator.chunk(chunk):
            yield event
    for event in translator.finish():
        yield event


async def messages(api, raw: Request, body: MessagesRequest):
    """POST /v1/messages: the chat path's answer in Anthropic's shape."""
    result = await api.chat(chat_body(body), raw)
    if isinstance(result, StreamingResponse):
        return StreamingResponse(_translate_stream(result.body_iterator, body.model),
                                 media_type="text/event-stream")
    return message_response(result, body.model)
