"""One JSON call object, `{"name": ..., "arguments": {...}}` ("parameters" is read too), read a
character at a time as the model writes it (CallObject), and CallStream, which turns that into a
parser's call deltas: the name as soon as it is complete, then the model's own text of the
arguments in fragments, so a client joining them gets exactly what the model wrote. The Hermes
and JSON formats both read their calls with it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pagedllm.structured.tool_parser_base import WHITESPACE, ToolParser

logger = logging.getLogger(__name__)

ARGUMENT_KEYS = ("arguments", "parameters")
_VALUE_STARTS = set('"{[-0123456789tfn')


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
        key = next((k for k in ARGUMENT_KEYS if k in self.fields), None)
        if key is None:
            return None
        start, end = self.fields[key]
        if self.text[start] != "{":
            return None
        return self.text[start:end if end >= 0 else len(self.text)], end >= 0

    def arguments_value(self) -> Any:
        key = next((k for k in ARGUMENT_KEYS if k in self.fields), None)
        return self._complete_value(key) if key else None

    def _step(self, char: str) -> bool:
        state = self._state
        if state == "key":
            self._key += char
            if char == '"' and not _escaped(self._key[:-1]):
                self._state = "colon"
            return True
        if char in WHITESPACE:
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


class CallStream:
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
        return not self._require_arguments and not any(k in self.obj.fields for k in ARGUMENT_KEYS)

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
