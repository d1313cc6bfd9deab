"""The "hermes" tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of them, with content before, between and after (Qwen2.5's template, Hermes models, and
our fallback tools prompt). A `<tool_call>` block that is not a call object stays content; a
tag cut at the end of a piece of text waits for the next piece.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.structured.tool_call_reader import CallStream
from pagedllm.structured.tool_parser_base import WHITESPACE, ToolParser, new_call_id


class HermesToolParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        super().__init__(new_id)
        self._held = ""  # text that may be the start of a tag
        self._call: CallStream | None = None
        self._raw = ""  # the current <tool_call> block's text, for when it is not a call

    def _consume(self, text: str) -> None:
        self._held += text
        while self._held:
            if self._call is None and not self._read_content():
                return
            if self._call is not None and not self._read_call():
                return

    def _read_content(self) -> bool:
        """Emit content up to a <tool_call>; False when waiting for more text."""
        start = self._held.find(self.OPEN)
        if start < 0:
            keep = _partial_suffix(self._held, self.OPEN)
            self._content(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return False
        self._content(self._held[:start])
        self._held = self._held[start + len(self.OPEN):]
        self._call, self._raw = CallStream(self, require_arguments=False), self.OPEN
        return True

    def _read_call(self) -> bool:
        """Read the call's object and its closing tag; False when waiting for more text."""
        call = self._call
        while self._held and not call.obj.done:
            char = self._held[0]
            if not call.obj.text and char in WHITESPACE:
                pass
            elif not call.feed(char):
                self._not_a_call()
                return True
            self._raw += char
            self._held = self._held[1:]
        if not call.obj.done:
            return False
        rest = self._held.lstrip(WHITESPACE)
        if not call.is_call and not call.started:
            self._not_a_call()
            return True
        if rest.startswith(self.CLOSE):
            self._held = rest[len(self.CLOSE):]
        elif self.CLOSE.startswith(rest):
            return False  # the closing tag may still be arriving
        call.finish()
        self._call = None
        return True

    def _not_a_call(self) -> None:
        """The block is not a call object: its text so far is content."""
        if self._call.started:  # deltas already went out: keep the call, the rest is content
            self._call.finish()
        else:
            self._content(self._raw)
        self._call = None

    def _end(self) -> None:
        if self._call is not None:
            if self._call.started:
                self._call.finish()
            else:
                self._content(self._raw + self._held)
                self._held = ""
            self._call = None
        self._content(self._held)
        self._held = ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
