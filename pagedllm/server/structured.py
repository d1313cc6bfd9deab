"""Structured outputs and tool calling on the OpenAI endpoints: a request's fields turned into one
output constraint and the tools for its prompt; each answer read back for tool calls, whole or
as a stream of deltas.

What constrains the output, by tool_choice (pagedllm.structured.tools has the details):
- no tools, or "none": response_format / structured_outputs / guided_* if given, else nothing.
  With "none" the tools stay out of the prompt too: a model shown tools and told to call them
  writes calls that nobody would read.
- "auto": the same constraint (if any); the answer is parsed in the model's own call format,
  calls become message.tool_calls and finish_reason "tool_calls".
- "required" or a named function: the output is forced to be calls (a JSON array of calls /
  the function's arguments). A response_format as well is a 400: both would constrain the same
  output, and which one to obey would be a guess (the same rule as two constraint fields).
  "required" ends with finish_reason "tool_calls", a named function with "stop" (as OpenAI and
  vLLM answer). A whole answer cut by max_tokens has empty content (the rest of the forced JSON
  is no text), and a named function's call cut short is no call (OpenAI's and vLLM's answer);
  "required" keeps the calls it finished. A stream has sent the pieces by then.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.server.protocol import APIError
from pagedllm.structured.spec import GrammarSpec, spec_from_request
from pagedllm.structured.tool_parsers import (
    NamedToolParser,
    ParsedDelta,
    ParsedMessage,
    ToolCallDelta,
    ToolParser,
    make_parser,
)
from pagedllm.structured.tools import Tool, ToolChoice, parse_tool_choice, parse_tools, tool_call_spec

# The request fields that may each carry the output constraint, in the order they are named.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")


@dataclass
class OutputConstraint:
    """What one request asks of its output."""

    spec: GrammarSpec | None = None
    param: str | None = None  # the request field the spec came from, for errors
    tools: list[Tool] = field(default_factory=list)  # for the prompt
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    tool_call_format: str = "hermes"  # how the model writes calls (auto)

    def new_parser(self) -> ToolParser | None:
        """A fresh reader of one answer's tool calls (None: the answer is plain content)."""
        mode = self.tool_choice.mode
        if mode == "named":
            return NamedToolParser(self.tool_choice.name)
        if mode == "required":
            return make_parser("json")
        if mode == "auto":
            return make_parser(self.tool_call_format)
        return None


async def read_constraint_async(body, processor: InputProcessor,
                                chat_template: str | None = None) -> OutputConstraint:
    """read_constraint in a worker thread, when the body asks for anything at all."""
    if all(getattr(body, name, None) is None for name in (*CONSTRAINT_FIELDS, "tools", "tool_choice")):
        return OutputConstraint()
    return await asyncio.to_thread(read_constraint, body, processor, chat_template)


def read_constraint(body, processor: InputProcessor, chat_template: str | None = None) -> OutputConstraint:
    """The body's constraint and tools, checked, and its grammar compiled (in time, or a 400).
    chat_template: the server's, if not the model's (it decides the tool call format).
    Blocking work (schema checks, compiling): call it off the event loop."""
    constraint = OutputConstraint(tool_call_format=processor.tool_call_format(chat_template))
    given = {name: getattr(body, name) for name in CONSTRAINT_FIELDS}
    constraint.param = next((name for name, value in given.items() if value is not None), None)
    try:
        constraint.spec = spec_from_request(**given)
    except ValueError as exc:
        raise APIError(str(exc), param=constraint.param) from exc
    if getattr(body, "tools", None) is not None or getattr(body, "tool_choice", None) is not None:
        _read_tools(body, constraint)
    try:
        processor.check_grammar(constraint.spec)
    except ValueError as exc:
        raise APIError(str(exc), param=constraint.param) from exc
    return constraint


def _read_tools(body, constraint: OutputConstraint) -> None:
    try:
        tools = parse_tools(body.tools or [])
    except ValueError as exc:
        raise APIError(str(exc), param="tools") from exc
    try:
        choice = parse_tool_choice(body.tool_choice, tools)
    except ValueError as exc:
        raise APIError(str(exc), param="tool_choice") from exc
    if not tools:  # "auto" (or "none") with no tools: nothing to call, nothing to read
        return
    constraint.tool_choice = choice
    constraint.tools = tools if choice.mode != "none" else []
    forced = tool_call_spec(tools, choice, body.parallel_tool_calls)
    if forced is None:
        return
    if constraint.spec is not None:
        raise APIError(f"tool_choice {_describe(choice)} forces the output to be tool calls, and "
                       f"{constraint.param} constrains it too; send one of them", param="tool_choice")
    constraint.spec, constraint.param = forced, "tools"


def _describe(choice: ToolChoice) -> str:
    return repr(choice.mode) if choice.mode != "named" else f"naming the function {choice.name!r}"


class ToolCallReader:
    """One choice's answer read for tool calls: whole (message) or streamed (deltas)."""

    def __init__(self, constraint: OutputConstraint, parser: ToolParser):
        self._parser = parser
        self._mode = constraint.tool_choice.mode
        self._num_calls = 0

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole answer as an assistant message, and the choice's finish_reason."""
        parsed = ParsedMessage.from_deltas([self._parser.feed(text), self._parser.finish()])
        if finish_reason == "length" and self._mode == "named":  # the arguments were cut short
            return {"role": "assistant", "content": ""}, finish_reason
        self._num_calls += len(parsed.tool_calls)
        content = parsed.content
        if finish_reason == "length" and self._mode == "required":  # what is left is no text
            content = ""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        return message, self.finish_reason(finish_reason)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The next piece of a streamed answer as a chunk's delta, and the finish_reason (on the
        last piece)."""
        pieces = [self._parser.feed(text)]
        if finish_reason is not None:
            pieces.append(self._parser.finish())
        parsed = self._take(*pieces)
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        return delta, self.finish_reason(finish_reason)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if finish_reason == "stop" and self._num_calls and self._mode != "named":
            return "tool_calls"
        return finish_reason

    def _take(self, *deltas: ParsedDelta) -> ParsedDelta:
        """The deltas as one, a call's consecutive fragments joined (a parser reading a
        character at a time gives one per character; a chunk needs one per call)."""
        calls: list[ToolCallDelta] = []
        for call in (call for d in deltas for call in d.tool_calls):
            if calls and call.id is None and calls[-1].index == call.index:
                calls[-1] = replace(calls[-1], arguments=calls[-1].arguments + call.arguments)
            else:
                calls.append(call)
                self._num_calls += call.id is not None
        return ParsedDelta("".join(d.content for d in deltas), calls)

