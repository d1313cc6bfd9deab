"""Read tool calls out of model text, as the text arrives: content deltas and tool-call deltas.

Formats:
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with content
  before them (Qwen2.5's template, Hermes models, and our fallback tools prompt);
- "json": the whole answer is call objects, `{"name": ..., "parameters": {...}}` (Llama 3.x's
  JSON tool calling; "arguments" is read too), one after another separated by ";" or ",", or a
  JSON array of them (the output that tool_choice "required" forces);
- NamedToolParser: the whole output is the arguments of one known function (a named
  tool_choice).

A call's first delta carries its id and name; its arguments follow in fragments, the model's own
text of the arguments object as it arrives, so a client joining the fragments gets exactly what
the model wrote. parse_tool_calls() is the same parser fed the whole text at once, so a streamed
answer and a whole one always agree. What is not a call stays content: text before, between or
after calls (whitespace that only separates calls is dropped), a `<tool_call>` block or a JSON
answer that is not a call object. A call cut short (max_tokens) is returned as far as it got.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"
_VALUE_STARTS = set('"{[-0123456789tfn')


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
        stripped = text.rstrip(_WHITESPACE)
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


def parse_tool_calls(text: str, parser: ToolParser) -> ParsedMessage:
    """A whole answer, read by a fresh streaming parser in one go."""
    return ParsedMessage.from_deltas([parser.feed(text), parser.finish()])


def make_parser(kind: str, new_id: Callable[[], str] = new_call_id) -> ToolParser:
    parsers = {"hermes": HermesToolParser, "json": JsonToolParser}
    if kind not in parsers:
        raise ValueError(f"unknown tool call format {kind!r}; known: {', '.join(parsers)}")
    return parsers[kind](new_id)


def parser_for_template(chat_template: str | None) -> str:
    """The format a chat template's model writes calls in: Llama 3.x's JSON when the template
    asks for "parameters" objects, else Hermes (Qwen2.5, Hermes, and our fallback prompt)."""
    if chat_template and "<tool_call>" not in chat_template and '"parameters"' in chat_template:
        return "json"
    return "hermes"


class CallObject:
    """One call object, `{"name": ..., "arguments": {...}}`, read a character at a time. Tells
    the owner the name as soon as it is complete and then the arguments text as it arrives."""

    def __init__(self):
        self.text = ""
        self.fields: dict[str, tuple[int, int]] = {}  # key -> (start, end) of its raw value
        self.done = False
        self.invalid = False
        self._state = "key_or_end"
        self._key = ""
        self._value: _JsonValue | None = None

    def feed(self, char: str) -> bool:
        """Take one character (the first is "{"); False if it is past the object's end (the
        owner reads it itself) or does not fit an object."""
        if self.done or self.invalid:
            return False
        if not self.text:
            self.invalid = char != "{"
            self.text = char
            return not self.invalid
        if self._state == "value":
            if self._value.feed(char):
                self.text += char
                if self._value.done:
                    self._end_value()
                return True
            self._end_value()  # the char ended a number or literal: read it again below
        if not self._step(char):
            self.invalid = True
            return False
        self.text += char
        return True

    @property
    def name(self) -> str | None:
        value = self._complete_value("name")
        return value if isinstance(value, str) else None

    def arguments_text(self) -> tuple[str, bool] | None:
        """The arguments object's text so far and whether it is complete; None until its
        value has begun, or if it is not an object."""
        key = next((k for k in _ARGUMENT_KEYS if k in self.fields), None)
        if key is None:
            return None
        start, end = self.fields[key]
        if self.text[start] != "{":
            return None
        return self.text[start:end if end >= 0 else len(self.text)], end >= 0

    def arguments_value(self) -> Any:
        key = next((k for k in _ARGUMENT_KEYS if k in self.fields), None)
        return self._complete_value(key) if key else None

    def _step(self, char: str) -> bool:
        state = self._state
        if state == "key":
            self._key += char
            if char == '"' and not _escaped(self._key[:-1]):
                self._state = "colon"
            return True
        if char in _WHITESPACE:
            return True
        if state == "key_or_end" and char == '"':
            self._key, self._state = "", "key"
            return True
        if state in ("key_or_end", "comma_or_end") and char == "}":
            self.done = True
            return True
        if state == "comma_or_end" and char == ",":
            self._state = "key_or_end"
            return True
        if state == "colon" and char == ":":
            self._state = "value_start"
            return True
        if state == "value_start" and char in _VALUE_STARTS:
            self._value = _JsonValue(char)
            self.fields[self._key_name()] = (len(self.text), -1)
            self._state = "value"
            return True
        return False

    def end_of_text(self) -> None:
        """No more text: a number or literal value still open ends here."""
        if self._state == "value" and self._value.complete_at_end():
            self._end_value()

    def _end_value(self) -> None:
        start, _ = self.fields[self._key_name()]
        self.fields[self._key_name()] = (start, len(self.text))
        self._state = "comma_or_end"

    def _key_name(self) -> str:
        try:
            return json.loads('"' + self._key)
        except json.JSONDecodeError:
            return self._key[:-1]

    def _complete_value(self, key: str) -> Any:
        start, end = self.fields.get(key, (0, -1))
        if end < 0:
            return None
        try:
            return json.loads(self.text[start:end])
        except json.JSONDecodeError:
            return None


class _JsonValue:
    """Where one JSON value ends, found a character at a time (strings and nesting aware)."""

    _SCALAR = set("0123456789+-.eEtrufalsn")

    def __init__(self, first: str):
        self._kind = "string" if first == '"' else "nested" if first in "{[" else "scalar"
        self._depth = 1 if self._kind == "nested" else 0
        self._in_string = self._kind == "string"
        self._escape = False
        self.done = False

    def feed(self, char: str) -> bool:
        """Whether char belongs to the value (the first char was given to __init__)."""
        if self.done:
            return False
        if self._kind == "scalar":
            return char in self._SCALAR
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                self.done = self._kind == "string"
            return True
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            self.done = self._depth == 0
        return True

    def complete_at_end(self) -> bool:
        return self._kind == "scalar"


def _escaped(text: str) -> bool:
    """Whether the character after text is escaped (an odd run of backslashes ends text)."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1


class _CallStream:
    """Turns a CallObject's progress into deltas: the call starts when its name is complete and
    its arguments have begun as an object (or, for other arguments, when the object is complete),
    then each new piece of the arguments object follows."""

    def __init__(self, parser: ToolParser, require_arguments: bool):
        self.obj = CallObject()
        self._parser = parser
        self._require_arguments = require_arguments
        self._index: int | None = None
        self._sent = 0

    @property
    def started(self) -> bool:
        return self._index is not None

    def feed(self, char: str) -> bool:
        taken = self.obj.feed(char)
        if taken:
            self._emit()
        return taken

    def finish(self) -> None:
        """At the object's end (or the text's): arguments written as a JSON string, or missing,
        are sent now."""
        self.obj.end_of_text()
        self._emit()
        if not self.started:
            return
        arguments = self.obj.arguments_text()
        if arguments is None and not self._sent:
            value = self.obj.arguments_value()
            text = value if isinstance(value, str) else "{}"
            self._parser._arguments(self._index, text)
            self._sent = len(text)
        elif arguments is not None and arguments[1]:
            _warn_if_invalid(self.obj.name, arguments[0])

    @property
    def is_call(self) -> bool:
        """A complete object that is a call: a name, and arguments that are an object, a JSON
        string, or (where allowed) absent."""
        if not self.obj.done or self.obj.name is None:
            return False
        if self.obj.arguments_text() is not None or isinstance(self.obj.arguments_value(), str):
            return True
        return not self._require_arguments and not any(k in self.obj.fields for k in _ARGUMENT_KEYS)

    def _emit(self) -> None:
        if not self.started:
            if self.obj.name is None:
                return
            if self.obj.arguments_text() is None and not self.is_call:
                return
            self._index = self._parser._start_call(self.obj.name)
        arguments = self.obj.arguments_text()
        if arguments is not None:
            self._parser._arguments(self._index, arguments[0][self._sent:])
            self._sent = len(arguments[0])


def _warn_if_invalid(name: str | None, arguments: str) -> None:
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        logger.info("tool call %r: the model wrote arguments that are not valid JSON", name)


class HermesToolParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        super().__init__(new_id)
        self._held = ""  # text that may be the start of a tag
        self._call: _CallStream | None = None
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
        self._call, self._raw = _CallStream(self, require_arguments=False), self.OPEN
        return True

    def _read_call(self) -> bool:
        """Read the call's object and its closing tag; False when waiting for more text."""
        call = self._call
        while self._held and not call.obj.done:
            char = self._held[0]
            if not call.obj.text and char in _WHITESPACE:
                pass
            elif not call.feed(char):
                self._not_a_call()
                return True
            self._raw += char
            self._held = self._held[1:]
        if not call.obj.done:
            return False
        rest = self._held.lstrip(_WHITESPACE)
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


class JsonToolParser(ToolParser):
    """Call objects one after another, or a JSON array of them; anything else is content."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        super().__init__(new_id)
        self._state = "start"  # start | between | call | content
        self._in_array = False
        self._call: _CallStream | None = None
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
        if char in _WHITESPACE:
            return
        if self._state == "start" and char == "[" and not self._in_array:
            self._in_array = True
            return
        if char == "{" and self._state in ("start", "between"):
            self._call, self._state = _CallStream(self, require_arguments=True), "call"
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


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
