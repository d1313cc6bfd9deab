"""The "harmony" tool-call format (gpt-oss): a call is a commentary-channel message to a function,

    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...arguments...}<|call|>

or with the recipient in the role header, `to=functions.NAME<|channel|>commentary json<|message|>`
(the answer's `<|start|>assistant` already dropped by the gpt_oss reasoning parser, which reads
these markers: they are special tokens, kept in the text). `<|call|>` ends the model's turn (an
EOS id of gpt-oss's), so an answer holds one call: it must open the answer (after whitespace);
anything else is content, as a final-channel answer is. The header is held back until its
`<|message|>` shows whether it names a function; the arguments stream as the model writes them,
a trailing `<|call|>` dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pagedllm.structured.tool_parser_base import WHITESPACE, ToolParser, new_call_id

_OPENERS = ("<|channel|>commentary", "to=functions.", "<|start|>assistant")
_MESSAGE, _CALL = "<|message|>", "<|call|>"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_MAX_HEADER = 256  # characters: a header longer than this is no call's


class HarmonyToolParser(ToolParser):
    def __init__(self, new_id: Callable[[], str] = new_call_id):
        super().__init__(new_id)
        self._state = "start"  # "start" (deciding) | "arguments" | "content"
        self._held = ""  # the answer's beginning while it may be a call's header; a maybe-<|call|>
        self._index = -1  # the call's, once started
        self._sent_any = False

    def _consume(self, text: str) -> None:
        self._held += text
        if self._state == "start":
            self._decide()
        if self._state == "arguments":
            self._read_arguments()
        elif self._state == "content":
            self._content(self._held)
            self._held = ""

    def _decide(self) -> None:
        """A call's header, not one, or wait for more of it."""
        head = self._held.lstrip(WHITESPACE)
        opens = any(head.startswith(o) or o.startswith(head) for o in _OPENERS)
        end = head.find(_MESSAGE)
        if opens and end < 0 and len(head) <= _MAX_HEADER:
            return  # maybe a header: wait for its <|message|>
        recipient = _RECIPIENT.search(head[:end]) if opens and end >= 0 else None
        if recipient is None:
            self._state = "content"
            return
        self._index = self._start_call(recipient.group(1))
        self._held = head[end + len(_MESSAGE):]
        self._state = "arguments"

    def _read_arguments(self) -> None:
        """Give out the arguments, holding back what may be the beginning of <|call|>."""
        held = self._held
        at = held.find(_CALL)
        if at >= 0:
            held = held[:at]  # the turn's end: nothing after it is the model's
        keep = 0 if at >= 0 else next((n for n in range(min(len(held), len(_CALL) - 1), 0, -1)
                                       if _CALL.startswith(held[-n:])), 0)
        self._argument(held[:len(held) - keep])
        self._held = "" if at >= 0 else held[len(held) - keep:]
        if at >= 0:
            self._state = "done"

    def _argument(self, fragment: str) -> None:
        self._arguments(self._index, fragment)
        self._sent_any = self._sent_any or bool(fragment.strip(WHITESPACE))

    def _end(self) -> None:
        if self._state == "start":
            self._content(self._held)  # an unfinished header: content
        elif self._state == "arguments":
            self._argument(self._held)
        if self._index >= 0 and not self._sent_any:
            self._arguments(self._index, "{}")
        self._held = ""
