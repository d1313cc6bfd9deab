"""Reasoning output (--reasoning-parser) with the official openai client against a served model.

The model is the tiny random Llama (byte tokenizer) with more positions, run as `pagedllm serve`
runs it (the engine core in its own process), with a scripted step (tests/server/scripted_core.py):
a prompt holding SAY[text]END makes the model's logits pick `text`, byte by byte, then EOS. The
script only replaces the model's numbers: the engine's grammar masks still apply to them, so a
JSON schema or a thinking budget shows in the answer exactly as it would with a real model.
Chat templates: a Qwen3-style one (enable_thinking false closes the reasoning in the prompt), a
DeepSeek-R1-style one (the prompt opens it) and gpt-oss's Harmony (its markers special tokens of
the tokenizer, said as such by the script).
"""

from __future__ import annotations

import json

import openai
import pytest

from pagedllm.server.protocol import APIError
from pagedllm.server.reasoning import constraint_after_reasoning
from pagedllm.structured.spec import GrammarSpec
from tests.server.conftest import RunningServer, tiny_config
from tests.server.scripted_core import HARMONY_TOKENS

QWEN3_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}")
R1_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|Assistant|><think>\\n' }}{% endif %}")
HARMONY_TEMPLATE = (
    "{% if tools %}{{ '<|start|>developer<|message|># Tools' }}{% for t in tools %}"
    "{{ ' functions.' + t['function']['name'] }}{% endfor %}{{ '<|end|>' }}{% endif %}"
    "{% for m in messages %}{{ '<|start|>' + m['role'] }}{% if m['role'] == 'assistant' %}"
    "{{ '<|channel|>final' }}{% endif %}{{ '<|message|>' + m['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory):
    from tests.model.tiny import make_hf_model, save_checkpoint

    model = make_hf_model("llama_gqa_untied", max_position_embeddings=2048)
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny-long"))


@pytest.fixture(scope="module")
def harmony_tiny_model(long_tiny_model, tmp_path_factory):
    """The same model with Harmony's markers as special tokens 258-264 (scripted_core's)."""
    import shutil

    from tokenizers import AddedToken

    from tests.model.tiny import tokenizer_backend

    folder = tmp_path_factory.mktemp("tiny-harmony")
    shutil.copytree(long_tiny_model, folder, dirs_exist_ok=True)
    backend = tokenizer_backend()
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in HARMONY_TOKENS])
    assert [backend.token_to_id(m) for m in HARMONY_TOKENS] == list(HARMONY_TOKENS.values())
    backend.save(str(folder / "tokenizer.json"))
    return folder


def _server(model_dir, parser: str, template: str) -> RunningServer:
    config = tiny_config(model_dir, max_model_len=2048, num_kv_blocks=512)
    return RunningServer(config, with_hooks=False, extensions=("tests.server.scripted_core",),
                         chat_template=template, reasoning_parser=parser)


@pytest.fixture(scope="module")
def qwen3(long_tiny_model):
    with _server(long_tiny_model, "qwen3", QWEN3_TEMPLATE) as running:
        yield openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def r1(long_tiny_model):
    with _server(long_tiny_model, "deepseek_r1", R1_TEMPLATE) as running:
        yield openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def gpt_oss(harmony_tiny_model):
    with _server(harmony_tiny_model, "gpt_oss", HARMONY_TEMPLATE) as running:
        yield openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


def ask(client, script: str, stream: bool = False, max_tokens: int = 400, **kwargs):
    return client.chat.completions.create(
        model="smollm2-test", messages=[{"role": "user", "content": f"SAY[{script}]END"}],
        max_tokens=max_tokens, temperature=0, stream=stream, **kwargs)


def streamed(client, script: str, **kwargs) -> tuple[list[str], list[str], list, str | None]:
    """The reasoning pieces, the content pieces, the tool-call deltas, the finish reason; checked
    to come in that order (no reasoning after content)."""
    reasoning, content, calls, finish, order = [], [], [], None, []
    for chunk in ask(client, script, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            piece = getattr(delta, "reasoning_content", None)
            if piece:
                assert getattr(delta, "reasoning", None) == piece
                reasoning.append(piece)
                order.append("r")
            if delta.content:
                content.append(delta.content)
                order.append("c")
            calls += delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert "".join(order) == "r" * order.count("r") + "c" * order.count("c"), order
    return reasoning, content, calls, finish


def reasoning_and_content(client, script: str, stream: bool, **kwargs):
    """The answer's reasoning and content, whole or joined from its stream, and the whole response
    (None when streamed)."""
    if stream:
        reasoning, content, _, _ = streamed(client, script, **kwargs)
        return "".join(reasoning), "".join(content), None
    response = ask(client, script, **kwargs)
    message = response.choices[0].message
    return message.reasoning_content, message.content, response


THOUGHT = "<think>\nLet me think {about} it, \"carefully\".\n</think>\n\nHello there!"


def test_the_reasoning_is_apart_from_the_content(qwen3):
    message = ask(qwen3, THOUGHT).choices[0].message
    assert message.reasoning_content == 'Let me think {about} it, "carefully".'
    assert message.reasoning == message.reasoning_content  # vLLM's newer name
    assert message.content == "Hello there!"


def test_streamed_reasoning_comes_first_and_joins_to_the_same(qwen3):
    reasoning, content, _, finish = streamed(qwen3, THOUGHT)
    assert len(reasoning) > 1 and len(content) > 1  # streamed piece by piece, not at the end
    assert "".join(reasoning) == 'Let me think {about} it, "carefully".'
    assert "".join(content) == "Hello there!"
    assert finish == "stop"


@pytest.mark.parametrize("script", ["Plain answer.", "<think>x</think>y"])
def test_thinking_turned_off_by_the_template_gives_no_reasoning(qwen3, script):
    kwargs = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    message = ask(qwen3, script, **kwargs).choices[0].message
    assert message.reasoning_content is None and message.content == script
    reasoning, content, _, _ = streamed(qwen3, script, **kwargs)
    assert reasoning == [] and "".join(content) == script


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_applies_to_the_content_after_the_reasoning(qwen3, stream):
    """The reasoning holds braces and quotes no JSON grammar would let through; the answer is
    the schema's."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    script = '<think>The {answer} is "42".</think>\n\n{"answer": 42}'
    reasoning, content, _ = reasoning_and_content(qwen3, script, stream, response_format=fmt)
    assert reasoning == 'The {answer} is "42".'
    assert json.loads(content) == {"answer": 42}


def test_the_schema_holds_an_answer_the_model_would_not_give(qwen3):
    """The script wants plain text after its reasoning; the grammar makes it JSON of the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    message = ask(qwen3, "<think>hmm</think>\n\nnot json at all", response_format=fmt).choices[0].message
    assert message.reasoning_content == "hmm"
    assert isinstance(json.loads(message.content)["answer"], int)


TOOL_SCRIPT = ('<think>The user wants the weather; I call the tool.</think>\n\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_tool_calls_after_the_reasoning(qwen3):
    choice = ask(qwen3, TOOL_SCRIPT, tools=[WEATHER], tool_choice="auto").choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants the weather; I call the tool."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not choice.message.content


def test_streamed_tool_calls_after_the_reasoning(qwen3):
    reasoning, content, calls, finish = streamed(qwen3, TOOL_SCRIPT, tools=[WEATHER], tool_choice="auto")
    assert "".join(reasoning) == "The user wants the weather; I call the tool."
    assert finish == "tool_calls" and not "".join(content).strip()
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}


LONG_THOUGHT = "<think>a long chain of thought that goes on and on</think>\n\nDone."


@pytest.mark.parametrize("stream", [False, True])
def test_the_thinking_budget_caps_the_reasoning(qwen3, stream):
    """Byte tokens: a budget of 10 is 10 characters of reasoning, then </think> is forced and the
    model goes on to its answer."""
    kwargs = {"extra_body": {"thinking_token_budget": 10}}
    reasoning, content, response = reasoning_and_content(qwen3, LONG_THOUGHT, stream, **kwargs)
    if response is not None:
        # <think>, 10 of reasoning, </think> forced, \n\nDone., EOS
        assert response.usage.completion_tokens == 7 + 10 + 8 + 7 + 1
    assert reasoning == "a long cha"
    assert content == "Done."
    unbounded = ask(qwen3, LONG_THOUGHT, extra_body={"thinking_token_budget": 200}).choices[0].message
    assert unbounded.reasoning_content == "a long chain of thought that goes on and on"


def test_a_budget_and_a_schema_together(qwen3):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    script = '<think>thinking far too long about it</think>{"answer": 7}'
    budget = {"thinking_token_budget": 5}
    message = ask(qwen3, script, response_format=fmt, extra_body=budget).choices[0].message
    assert message.reasoning_content == "think"
    assert json.loads(message.content) == {"answer": 7}


def test_r1_reasoning_opened_by_the_prompt(r1):
    message = ask(r1, "I ponder.</think>\n\nThe answer.").choices[0].message
    assert (message.reasoning_content, message.content) == ("I ponder.", "The answer.")
    reasoning, content, _, _ = streamed(r1, "I ponder.</think>\n\nThe answer.")
    assert ("".join(reasoning), "".join(content)) == ("I ponder.", "The answer.")
    capped = ask(r1, "I ponder.</think>\n\nThe answer.", extra_body={"thinking_token_budget": 5})
    assert (capped.choices[0].message.reasoning_content, capped.choices[0].message.content) == \
        ("I pon", "The answer.")


def test_r1_reasoning_cut_by_max_tokens_is_all_reasoning(r1):
    choice = ask(r1, "still thinking when the tokens ran out", max_tokens=12).choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.reasoning_content, choice.message.content) == ("still thinki", None)


def test_bad_input_is_one_line(qwen3):
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        ask(qwen3, "x", extra_body={"thinking_token_budget": 0})
    with pytest.raises(APIError, match="needs a server started with --reasoning-parser"):
        constraint_after_reasoning(None, "prompt", GrammarSpec.json_object(), 10)
    assert constraint_after_reasoning(None, "prompt", None, None) is None


def test_an_unknown_parser_stops_start_up_in_one_line(capsys, core_starts):
    from pagedllm.cli import main

    assert main(["serve", "--model", "/nowhere/at/all", "--reasoning-parser", "qwen9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("pagedllm: error: unknown reasoning parser 'qwen9'; "
                   "known: qwen3, deepseek_r1, gpt_oss, openai_gptoss")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert core_starts == []


def test_each_choice_of_n_is_split(qwen3):
    choices = ask(qwen3, THOUGHT, n=2).choices
    assert [(c.message.reasoning_content, c.message.content) for c in choices] == \
        [('Let me think {about} it, "carefully".', "Hello there!")] * 2


JSON_SPEC = GrammarSpec.json_object()


@pytest.mark.parametrize("parser, prompt, spec, budget, expected", [
    ("qwen3", "<|im_start|>assistant\n", JSON_SPEC, None, ("json_object", "optional", None)),
    ("qwen3", "<|im_start|>assistant\n<think>\n", JSON_SPEC, 9, ("json_object", "open", 9)),
    ("deepseek_r1", "<|Assistant|>", JSON_SPEC, None, ("json_object", "open", None)),
    ("qwen3", "<|im_start|>assistant\n", None, 7, ("text", "optional", 7)),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", JSON_SPEC, 7, JSON_SPEC),  # thinking off
    ("qwen3", "<|im_start|>assistant\n", None, None, None),
])
def test_where_the_constraint_starts(parser, prompt, spec, budget, expected):
    from pagedllm.text.reasoning import reasoning_format

    moved = constraint_after_reasoning(reasoning_format(parser), prompt, spec, budget)
    if moved is None or moved.reasoning is None:
        assert moved == expected
    else:
        assert (moved.kind, moved.reasoning.mode, moved.reasoning.budget) == expected


HARMONY_THOUGHT = ('<|channel|>analysis<|message|>The user greets me; {"reply"} in kind.<|end|>'
                   "<|start|>assistant<|channel|>final<|message|>Hello there!")


def test_gpt_oss_channels_split_into_reasoning_and_content(gpt_oss):
    """Harmony's analysis channel is the reasoning, its final channel the content; the markers
    (special tokens, which a plain decode drops) are read and left out of both."""
    choice = ask(gpt_oss, HARMONY_THOUGHT, extra_body={"return_token_ids": True}).choices[0]
    assert {258, 259, 260, 261} <= set(choice.token_ids)  # said as special tokens
    assert choice.message.reasoning_content == 'The user greets me; {"reply"} in kind.'
    assert choice.message.reasoning == choice.message.reasoning_content
    assert choice.message.content == "Hello there!"
    assert choice.finish_reason == "stop"
    reasoning, content, _, finish = streamed(gpt_oss, HARMONY_THOUGHT)
    assert len(reasoning) > 1 and len(content) > 1
    assert ("".join(reasoning), "".join(content)) == (choice.message.reasoning_content, "Hello there!")
    assert finish == "stop"


def test_gpt_oss_final_channel_alone_is_all_content(gpt_oss):
    script = "<|channel|>final<|message|>Straight to the answer."
    message = ask(gpt_oss, script).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "Straight to the answer.")
    reasoning, content, _, _ = streamed(gpt_oss, script)
    assert reasoning == [] and "".join(content) == "Straight to the answer."


HARMONY_LONG_THOUGHT = ("<|channel|>analysis<|message|>a long chain of thought that goes on and on<|end|>"
                        "<|start|>assistant<|channel|>final<|message|>Done.")


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_thinking_budget_caps_the_analysis_channel(gpt_oss, stream):
    """Special tokens counted as any: 10 tokens of analysis, then <|end|> is forced and the model
    goes on to its final channel."""
    kwargs = {"extra_body": {"thinking_token_budget": 10}}
    reasoning, content, response = reasoning_and_content(gpt_oss, HARMONY_LONG_THOUGHT, stream, **kwargs)
    if response is not None:
        # <|channel|>analysis<|message|>, 10 of analysis, <|end|> forced,
        # <|start|>assistant<|channel|>final<|message|>, Done., EOS
        assert response.usage.completion_tokens == 10 + 10 + 1 + 17 + 5 + 1
    assert (reasoning, content) == ("a long cha", "Done.")


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_json_schema_applies_to_the_final_channel(gpt_oss, stream):
    """The analysis holds braces and quotes; the final channel's header comes before the answer,
    which is the schema's, even where the script wants plain text."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for script, expected in [(HARMONY_THOUGHT.replace("Hello there!", '{"answer": 42}'), {"answer": 42}),
                             (HARMONY_THOUGHT, None)]:
        reasoning, content, _ = reasoning_and_content(gpt_oss, script, stream, response_format=fmt)
        assert reasoning == 'The user greets me; {"reply"} in kind.'
        answer = json.loads(content)
        assert answer == expected if expected else isinstance(answer["answer"], int)


HARMONY_CALL = ("<|channel|>analysis<|message|>The user wants the weather; I call the tool.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"city": "Paris"}<|call|>')


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_tool_calls_after_the_analysis(gpt_oss, stream):
    """tools with tool_choice auto: Harmony's commentary message to functions.get_weather is the
    call, its body the arguments, after the reasoning (a Harmony template picks the format)."""
    kwargs = {"tools": [WEATHER], "tool_choice": "auto"}
    if stream:
        reasoning, content, calls, finish = streamed(gpt_oss, HARMONY_CALL, **kwargs)
        reasoning, content = "".join(reasoning), "".join(content)
        name = calls[0].function.name
        arguments = "".join(c.function.arguments or "" for c in calls)
    else:
        choice = ask(gpt_oss, HARMONY_CALL, **kwargs).choices[0]
        reasoning, content = choice.message.reasoning_content, choice.message.content
        finish = choice.finish_reason
        (call,) = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert reasoning == "The user wants the weather; I call the tool."
    assert finish == "tool_calls" and not (content or "").strip()
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Paris"})
    # Under a thinking budget (the grammar lets Harmony's tokens through after the analysis); the
    # tiny tokenizer's <|call|> is no EOS id, which it is for gpt-oss: the script ends without it.
    capped = ask(gpt_oss, HARMONY_CALL.removesuffix("<|call|>"), extra_body={"thinking_token_budget": 5},
                 **kwargs).choices[0]
    assert (capped.message.reasoning_content, capped.finish_reason) == ("The u", "tool_calls")
    assert json.loads(capped.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    final = ask(gpt_oss, HARMONY_THOUGHT, **kwargs).choices[0]  # a final-channel answer: no call
    assert (final.message.content, final.message.tool_calls) == ("Hello there!", None)
    assert final.finish_reason == "stop"
