"""Running a Responses request (server/responses.py says the mapping): the chat handler's answer
as a Response, or its stream as the Responses API's typed events (response.created, output items
added and done, text / reasoning / function-argument deltas, response.completed or
response.incomplete), each numbered. One output item is open at a time; the finished Response is
built from the items as they close, and stored like a whole one."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.server import responses as shapes
from pagedllm.server.chat_translation import chat_chunks
from pagedllm.server.formats import sse_json


class ResponseStream:
    def __init__(self, response_id: str, body: shapes.ResponsesRequest) -> None:
        self.response_id = response_id
        self.body = body
        self.sequence = 0
        self.output: list[dict] = []
        self.item: dict | None = None  # the open item
        self.finish: str | None = None
        self.usage: dict = {}

    def event(self, kind: str, **payload) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {sse_json(data)}\n\n"

    def start(self) -> list[str]:
        envelope = shapes._envelope(self.response_id, self.body, [], None, {})
        envelope["status"] = "in_progress"
        return [self.event("response.created", response=envelope),
                self.event("response.in_progress", response=envelope)]

    def chunk(self, chunk: dict) -> list[str]:
        events: list[str] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._open("reasoning")
                events += self._add_text(delta["reasoning_content"], "response.reasoning_text.delta")
            if delta.get("content"):
                events += self._open("message")
                events += self._add_text(delta["content"], "response.output_text.delta")
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    events += self._close()
                    events += self._open_call(call["id"], function.get("name", ""))
                if function.get("arguments") and self.item is not None:
                    self.item["arguments"] += function["arguments"]
                    events.append(self.event("response.function_call_arguments.delta",
                                             item_id=self.item["id"], output_index=len(self.output),
                                             delta=function["arguments"]))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def end(self) -> tuple[list[str], dict]:
        events = self._close()
        response = shapes._envelope(self.response_id, self.body, self.output, self.finish, self.usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=response)], response

    # -- items ---------------------------------------------------------------------------------
    def _open(self, kind: str) -> list[str]:
        if self.item is not None and self.item["type"] == kind:
            return []
        events = self._close()
        if kind == "message":
            self.item = {**shapes._message_item("", "in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            self.item = {**shapes._reasoning_item(""), "content": []}
            part = {"type": "reasoning_text", "text": ""}
        events.append(self.event("response.output_item.added", output_index=len(self.output),
                                 item=dict(self.item)))
        self.item["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=self.item["id"],
                                 output_index=len(self.output), content_index=0, part=dict(part)))
        return events

    def _open_call(self, call_id: str, name: str) -> list[str]:
        self.item = shapes._call_item(call_id, name, "", "in_progress")
        return [self.event("response.output_item.added", output_index=len(self.output), item=dict(self.item))]

    def _add_text(self, text: str, kind: str) -> list[str]:
        part = self.item["content"][0]
        part["text"] += text
        extra = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return [self.event(kind, item_id=self.item["id"], output_index=len(self.output), content_index=0,
                           delta=text, **extra)]

    def _close(self) -> list[str]:
        item, self.item = self.item, None
        if item is None:
            return []
        index, events = len(self.output), []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self.event(done, item_id=item["id"], output_index=index, content_index=0,
                                     text=part["text"], **extra))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        item["status"] = "completed"
        self.output.append(item)
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


async def translate(chunks: AsyncIterator, stream: ResponseStream,
                    on_done: Callable[[dict], None]) -> AsyncIterator[str]:
    for event in stream.start():
        yield event
    async for chunk in chat_chunks(chunks):
        if "error" in chunk:
            error = chunk["error"]
            yield stream.event("error", code=error.get("code"), message=error.get("message", ""),
                               param=error.get("param"))
            return
        for event in stream.chunk(chunk):
            yield event
    events, response = stream.end()
    on_done(response)
    for event in events:
        yield event


async def respond(api, raw: Request, body: shapes.ResponsesRequest, store: shapes.ResponseStore):
    """POST /v1/responses."""
    response_id = f"resp_{uuid.uuid4().hex}"
    api.extra_fields.check(body, response_id)
    messages = shapes.chat_messages(body, store)
    result = await api.chat(shapes.chat_body(body, messages), raw, prompt_tokens_details=True)

    def keep(response: dict) -> None:
        if body.store:
            store.put(response_id, shapes.stored_messages(messages, response), response)

    if isinstance(result, StreamingResponse):
        return StreamingResponse(translate(result.body_iterator, ResponseStream(response_id, body), keep),
                                 media_type="text/event-stream")
    response = shapes.response_object(response_id, result, body)
    keep(response)
    return response
