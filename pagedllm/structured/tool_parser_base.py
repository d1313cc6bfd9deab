"""What every tool-call parser shares: the deltas and the whole message they make, and the
streaming base class (feed() each new piece of text, finish() at the end) whose subclasses read
one format each (pagedllm.structured.tool_parsers lists them).

A call's first delta carries its id and name; its arguments follow in fragments. Whitespace that
only separates calls is held back until it is known to be content.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallDelta:
    index: int  # which call of the message (0, 1, ...)
    id: str | None = None  # on a call's first delta
    name: str | None = None  # on a call's first delta
    arguments: str = ""  # the next fragment of the arguments' JSON text

    def to_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            delta.update(id=self.id, type="function")
            function["name"] = self.name
        delta["function"] = function
        return delta


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    content: str | None  # None when the message is only tool calls
    tool_calls: list[ToolCall]

    @classmethod
    def from_deltas(cls, deltas: list[ParsedDelta]) -> ParsedMessage:
        content = "".join(d.content for d in deltas)
        calls: list[ToolCall] = []
        for delta in (c for d in deltas for c in d.tool_calls):
            if delta.id is not None:
                calls.append(ToolCall(delta.id, delta.name or "", ""))
            calls[delta.index].arguments += delta.arguments
        return cls(content if content or not calls else None, calls)


class ToolParser:
    """Streaming: feed() each new piece of text, finish() at the end; each returns a delta."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._new_id = new_id
        self._num_calls = 0
        self._pending_space = ""  # whitespace not yet known to be content
        self._out = ParsedDelta()

    def feed(self, text: str) -> ParsedDelta:
        self._consume(text)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._end()
        if not self._num_calls:
            self._out.content += self._pending_space
        self._pending_space = ""
        return self._take()

    # -- for subclasses -----------------------------------------------------------------------
    def _consume(self, text: str) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        """Content, except whitespace that may turn out to only separate tool calls."""
        if not text:
            return
        stripped = text.rstrip(WHITESPACE)
        if stripped:
            self._out.content += self._pending_space + stripped
            self._pending_space = ""
        self._pending_space += text[len(stripped):]

    def _start_call(self, name: str) -> int:
        self._pending_space = ""
        index = self._num_calls
        self._num_calls += 1
        self._out.tool_calls.append(ToolCallDelta(index, self._new_id(), name))
        return index

    def _arguments(self, index: int, fragment: str) -> None:
        if fragment:
            self._out.tool_calls.append(ToolCallDelta(index, arguments=fragment))

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out
