"""The "json" tool-call format, where the whole answer is call objects (Llama 3.x's JSON tool
calling): `{"name": ..., "parameters": {...}}` one after another, separated by ";" or ",", or a
JSON array of them (the output tool_choice "required" forces); an answer that is not a call object
stays content. And NamedToolParser: the whole output is the arguments of one known function (a
named tool_choice).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.structured.tool_call_reader import CallStream
from pagedllm.structured.tool_parser_base import WHITESPACE, ToolParser, new_call_id


class JsonToolParser(ToolParser):
    """Call objects one after another, or a JSON array of them; anything else is content."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        super().__init__(new_id)
        self._state = "start"  # start | between | call | content
        self._in_array = False
        self._call: CallStream | None = None
        self._raw = ""  # text read since the last call, while still unsure what it is

    def _consume(self, text: str) -> None:
        for i, char in enumerate(text):
            if self._state == "content":
                self._content(text[i:])
                return
            self._read(char)

    def _read(self, char: str) -> None:
        if self._state == "call":
            if not self._call.feed(char):
                self._to_content(char)
                return
            self._raw += char
            if self._call.obj.done:
                if not self._call.is_call:
                    self._to_content("")
                    return
                self._call.finish()
                self._call, self._state, self._raw = None, "between", ""
            return
        self._raw += char
        if char in WHITESPACE:
            return
        if self._state == "start" and char == "[" and not self._in_array:
            self._in_array = True
            return
        if char == "{" and self._state in ("start", "between"):
            self._call, self._state = CallStream(self, require_arguments=True), "call"
            self._call.feed(char)
            return
        if self._state == "between" and (char in ",;" or (char == "]" and self._in_array)):
            return
        self._to_content("")

    def _to_content(self, extra: str) -> None:
        """Not (or no longer) calls: the rest is content, and so is what was read since the last
        call unless it already went out as a call's deltas."""
        if self._call is not None and self._call.started:
            self._call.finish()
            self._content(extra)
        else:
            self._content(self._raw + extra)
        self._state, self._call, self._raw = "content", None, ""

    def _end(self) -> None:
        if self._call is not None and self._call.started:
            self._call.finish()
        elif self._call is not None or not self._num_calls:
            self._content(self._raw)  # an unfinished non-call, or no calls at all
        self._call, self._raw = None, ""


class NamedToolParser(ToolParser):
    """The whole output is the arguments of one function (a named tool_choice forced it)."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id):
        super().__init__(new_id)
        self._name = name
        self._index: int | None = None
        self._sent_any = False

    def _consume(self, text: str) -> None:
        if self._index is None:
            self._index = self._start_call(self._name)
        self._arguments(self._index, text)
        self._sent_any = self._sent_any or bool(text)

    def _end(self) -> None:
        if self._index is None:
            self._index = self._start_call(self._name)
        if not self._sent_any:  # nothing was generated: a call with no arguments
            self._arguments(self._index, "{}")
