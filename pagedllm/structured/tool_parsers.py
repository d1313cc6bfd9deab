"""Read tool calls out of model text, as the text arrives: content deltas and tool-call deltas.

Formats:
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with content
  before them (Qwen2.5's template, Hermes models, and our fallback tools prompt);
- "json": the whole answer is call objects, `{"name": ..., "parameters": {...}}` (Llama 3.x's
  JSON tool calling; "arguments" is read too), one after another separated by ";" or ",", or a
  JSON array of them (the output that tool_choice "required" forces);
- "harmony": gpt-oss's commentary-channel message to `functions.NAME`, its body the arguments
  (tool_parser_harmony; it needs the gpt_oss reasoning parser, which keeps Harmony's markers);
- NamedToolParser: the whole output is the arguments of one known function (a named
  tool_choice).

A call's first delta carries its id and name; its arguments follow in fragments, the model's own
text of the arguments object as it arrives, so a client joining the fragments gets exactly what
the model wrote. parse_tool_calls() is the same parser fed the whole text at once, so a streamed
answer and a whole one always agree. What is not a call stays content: text before, between or
after calls (whitespace that only separates calls is dropped), a `<tool_call>` block or a JSON
answer that is not a call object. A call cut short (max_tokens) is returned as far as it got.

Where each part lives: tool_parser_base (the deltas, the message, the streaming base class),
tool_call_reader (one call object read a character at a time), tool_parser_hermes,
tool_parser_json and tool_parser_harmony (the formats); this module picks one.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.structured.tool_parser_base import (
    ParsedDelta,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)
from pagedllm.structured.tool_parser_harmony import HarmonyToolParser
from pagedllm.structured.tool_parser_hermes import HermesToolParser
from pagedllm.structured.tool_parser_json import JsonToolParser, NamedToolParser

__all__ = ["HarmonyToolParser", "HermesToolParser", "JsonToolParser", "NamedToolParser", "ParsedDelta",
           "ParsedMessage", "ToolCall", "ToolCallDelta", "ToolParser", "make_parser", "new_call_id",
           "parse_tool_calls", "parser_for_template"]


def parse_tool_calls(text: str, parser: ToolParser) -> ParsedMessage:
    """A whole answer, read by a fresh streaming parser in one go."""
    return ParsedMessage.from_deltas([parser.feed(text), parser.finish()])


def make_parser(kind: str, new_id: Callable[[], str] = new_call_id) -> ToolParser:
    parsers = {"hermes": HermesToolParser, "json": JsonToolParser, "harmony": HarmonyToolParser}
    if kind not in parsers:
        raise ValueError(f"unknown tool call format {kind!r}; known: {', '.join(parsers)}")
    return parsers[kind](new_id)


def parser_for_template(chat_template: str | None) -> str:
    """The format a chat template's model writes calls in: gpt-oss's Harmony where the template
    writes Harmony's channels; Llama 3.x's JSON when it asks for "parameters" objects; else
    Hermes (Qwen2.5, Hermes, and our fallback prompt)."""
    if chat_template and "<|channel|>" in chat_template:
        return "harmony"
    if chat_template and "<tool_call>" not in chat_template and '"parameters"' in chat_template:
        return "json"
    return "hermes"
