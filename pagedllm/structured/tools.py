"""Tool calling without the engine: check `tools` and `tool_choice`, build the schema that forces
valid calls, and give tools to models whose chat template has no place for them.

`tool_choice` decides what is constrained and how the output is read back:
- "none": tools are neither constrained nor parsed;
- "auto" (the default when tools are given): free text, read by the model's own format's parser
  (tool_parsers.parser_for_template);
- a named function: the output is forced to be that function's arguments, a JSON object valid
  against its parameters schema, and becomes one call of it;
- "required": the output is forced to be a JSON array of one or more calls,
  [{"name": <a tool's name>, "parameters": <its arguments>}, ...] (at most one call when
  parallel_tool_calls is false), read back by the JSON call parser.

Templates without a tools section (the default SmolLM2's) get the tools in the system message in
Qwen2.5's own words (TOOLS_PROMPT), and are asked to answer in Hermes' format:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>
Assistant tool calls and tool results in the history are written in that format too
(`<tool_call>` in the assistant's text, `<tool_response>` in a user turn), as Qwen2.5's template
writes them, so the conversation reads the same way it is answered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedllm.structured.compiler import check_grammar
from pagedllm.structured.schema_defs import NestedSchemas
from pagedllm.structured.spec import GrammarSpec

MAX_TOOLS = 128
MAX_NAME_LENGTH = 64  # OpenAI's bound on a function name
_NAME = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_NAME_LENGTH}}}")

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: Mapping[str, Any]  # a JSON schema for the arguments object
    description: str | None = None

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the function, when mode is "named"


def parse_tools(tools: Any) -> list[Tool]:
    """OpenAI's `tools` list, checked: each a function with a unique name and a parameters
    schema that compiles. Errors name the tool."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of tools; got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are allowed; got {len(tools)}")
    parsed = [_parse_tool(i, tool) for i, tool in enumerate(tools)]
    seen: set[str] = set()
    for tool in parsed:
        if tool.name in seen:
            raise ValueError(f"tools: the name {tool.name!r} is used twice")
        seen.add(tool.name)
    return parsed


def parse_tool_choice(tool_choice: Any, tools: Sequence[Tool]) -> ToolChoice:
    """`tool_choice` checked against the tools (None: "auto" with tools, else "none")."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        return ToolChoice(tool_choice)
    is_object = isinstance(tool_choice, Mapping)
    function = tool_choice.get("function") if is_object else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not (is_object and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         '{"type": "function", "function": {"name": ...}}; '
                         f"got {json.dumps(tool_choice, default=str)[:120]}")
    if name not in {tool.name for tool in tools}:
        known = ", ".join(tool.name for tool in tools) or "no tools were given"
        shown = (repr(name) if len(name) <= MAX_NAME_LENGTH
                 else f"{name[:MAX_NAME_LENGTH]!r}... ({len(name)} characters)")
        raise ValueError(f"tool_choice names the function {shown}, which is not in tools ({known})")
    return ToolChoice("named", name)


def tool_call_spec(tools: Sequence[Tool], choice: ToolChoice,
                   parallel_tool_calls: bool = True) -> GrammarSpec | None:
    """The constraint that makes the output a valid call (None for "none" and "auto")."""
    if choice.mode == "named":
        return GrammarSpec.json_schema(_tool_named(tools, choice.name).parameters)
    if choice.mode != "required":
        return None
    # Each tool's parameters sit inside the array's schema: their $defs move to its root.
    nested = NestedSchemas()
    calls = [_call_schema(tool.name, nested.nest(dict(tool.parameters), tool.name)) for tool in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls} if len(calls) > 1 else calls[0],
                              "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if nested.defs:
        schema["$defs"] = nested.defs
    return GrammarSpec.json_schema(schema)


def template_has_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (else the fallback prompt is used)."""
    if not chat_template:
        return False
    try:
        # Parsed (never rendered) in the sandbox the templates render in.
        names = jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in names


def messages_with_tools_prompt(messages: Sequence[Mapping[str, Any]],
                               tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The conversation for a template without a tools section: the tools prompt joins the
    system message (or becomes one), assistant tool calls are written into the assistant's text
    and tool results become user turns, all in the format the prompt asks for."""
    rewritten = [_plain_message(message) for message in messages]
    if not tools:
        return rewritten
    prompt = TOOLS_PROMPT.format(tools="\n".join(
        json.dumps(tool.to_openai(), ensure_ascii=False) for tool in tools))
    if rewritten and rewritten[0].get("role") == "system":
        system = rewritten[0]
        system["content"] = f"{system.get('content') or ''}\n\n{prompt}".lstrip()
    else:
        rewritten.insert(0, {"role": "system", "content": prompt})
    return rewritten


def call_arguments_as_objects(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The conversation for a template with a tools section: OpenAI sends a call's arguments as
    JSON text, templates (Qwen2.5's, Llama 3.1's) write them with `| tojson`, so they get the
    object (as vLLM and transformers give it); text that is not JSON stays text."""
    return [_with_argument_objects(m) if m.get("tool_calls") else m for m in messages]


def _with_argument_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            call = {**call, "function": {**function,
                                         "arguments": _json_or_text(function["arguments"])}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    role, content = message.get("role"), message.get("content")
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content or ''}\n</tool_response>"}
    calls = message.get("tool_calls") if role == "assistant" else None
    if not calls:
        return dict(message)
    parts = [content] if content else []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            arguments = _json_or_text(arguments)
        parts.append("<tool_call>\n" + json.dumps(
            {"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
            + "\n</tool_call>")
    return {"role": "assistant", "content": "\n".join(parts)}


def _parse_tool(index: int, tool: Any) -> Tool:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" \
            or not isinstance(tool.get("function"), Mapping):
        raise ValueError(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"tools[{index}].function.name must be 1-{MAX_NAME_LENGTH} letters, digits, "
                         f"'_' or '-'; got {name!r}"[:200])
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"tool {name!r}: description must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    _check_parameters(name, parameters)
    return Tool(name, parameters, description)


def _check_parameters(name: str, parameters: Any) -> None:
    """A call's arguments are a JSON object, so the schema must be an object schema, and one
    the grammar compiler accepts."""
    if not isinstance(parameters, Mapping):
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema object; "
                         f"got {type(parameters).__name__}")
    if parameters.get("type", "object") != "object":
        raise ValueError(f"tool {name!r}: parameters must describe an object (type 'object'); "
                         f"got type {parameters.get('type')!r}")
    try:
        check_grammar(GrammarSpec.json_schema(parameters))
    except ValueError as exc:  # a GrammarError, or a spec over its bounds
        raise ValueError(f"tool {name!r}: parameters is not a usable JSON schema: {exc}") from None


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": name}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


def _tool_named(tools: Sequence[Tool], name: str | None) -> Tool:
    for tool in tools:
        if tool.name == name:
            return tool
    raise ValueError(f"no tool named {name!r}")


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
