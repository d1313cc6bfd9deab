"""Tools in the chat prompt (the input processor): a template with a tools section gets the tools
and the history's calls with their arguments as objects; one without (the tiny model's, like
SmolLM2's) gets the documented system-message fallback, with calls and tool results written as
text in the format it asks for; and the call format the server parses follows the template."""

from __future__ import annotations

import json

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.structured.tools import TOOLS_PROMPT, parse_tools
from pagedllm.text.tokenizer import Tokenizer
from tests.model.tiny import BOS, CHAT_TEMPLATE, EOS, tokenizer_backend

# Qwen2.5's way, cut down: tools as JSON lines, calls in <tool_call> tags, tool results as such.
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
# Llama 3.1's way, cut down: calls as {"name": ..., "parameters": ...}.
LLAMA3_TEMPLATE = (
    "{% if tools %}Respond with {\"name\": function name, \"parameters\": arguments}."
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")

TOOLS = parse_tools([{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": '{"temperature": 18}', "tool_call_id": "call_1"},
]


def processor(template: str) -> InputProcessor:
    tokenizer = Tokenizer(tokenizer_backend(), {"bos_token": BOS, "eos_token": EOS}, template)
    return InputProcessor(tokenizer, 300, 100_000)


def test_a_template_with_tools_gets_them_and_the_calls_arguments_as_objects():
    tools_processor = processor(HERMES_TEMPLATE)
    prompt = tools_processor.chat_prompt(HISTORY, tools=TOOLS)["prompt"]
    assert prompt.startswith("<tools>" + json.dumps(TOOLS[0].to_openai()))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert '<tool>{"temperature": 18}[call_1]' in prompt
    assert tools_processor.has_tools_section() and tools_processor.tool_call_format() == "hermes"
    assert processor(LLAMA3_TEMPLATE).tool_call_format() == "json"
    # a template given per call (the server's --chat-template) decides for itself
    assert processor(CHAT_TEMPLATE).tool_call_format(LLAMA3_TEMPLATE) == "json"
    assert not tools_processor.has_tools_section(CHAT_TEMPLATE)


def test_a_template_without_tools_gets_them_in_the_system_message():
    plain = processor(CHAT_TEMPLATE)
    prompt = plain.chat_prompt(HISTORY, tools=TOOLS)["prompt"]
    tools_text = TOOLS_PROMPT.format(tools=json.dumps(TOOLS[0].to_openai()))
    assert prompt.startswith(f"{BOS}<system>{tools_text}{EOS}<user>Weather in Paris?{EOS}")
    assert ('<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            f"</tool_call>{EOS}") in prompt
    assert f'<user><tool_response>\n{{"temperature": 18}}\n</tool_response>{EOS}<assistant>' in prompt
    assert not plain.has_tools_section() and plain.tool_call_format() == "hermes"
    assert "<tools>" in plain.chat_prompt(HISTORY, tools=TOOLS, chat_template=HERMES_TEMPLATE)["prompt"]


def test_a_conversation_without_tools_renders_as_before():
    plain = processor(CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert plain.chat_prompt(messages)["prompt"] == \
        plain.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
