"""Reasoning parsers: the incremental splitter against a whole-text reference, under every way of
cutting the answer into pieces (hypothesis), and the prompt's end deciding where answers start."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.text.reasoning import (
    REASONING_PARSERS,
    ReasoningFormat,
    ReasoningSplitter,
    prompt_state,
    reasoning_format,
)

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]
HARMONY = REASONING_PARSERS["gpt_oss"]


def reference_split(fmt: ReasoningFormat, state: str, text: str) -> tuple[str | None, str | None]:
    """The rules of pagedllm.text.reasoning, on the whole text at once (the oracle)."""
    if state == "content":
        return None, without_headers(fmt, text) or None
    body = text
    if state == "start":
        stripped = text.lstrip()
        if stripped.startswith(fmt.start):
            body = stripped[len(fmt.start):]
        elif fmt.implicit_start:
            body = stripped
        else:
            return None, without_headers(fmt, stripped) or None
    if fmt.end in body:
        reasoning, content = body.split(fmt.end, 1)
        return reasoning.strip() or None, without_headers(fmt, content) or None
    return body.strip() or None, None


def without_headers(fmt: ReasoningFormat, content: str) -> str:
    """The content, its leading whitespace and the headers it opens with (in order) dropped."""
    content = content.lstrip()
    for header in fmt.content_headers:
        if content.startswith(header):
            content = content[len(header):].lstrip()
    return content


def streamed(fmt: ReasoningFormat, state: str, pieces: list[str]) -> list[tuple[str, str]]:
    splitter = ReasoningSplitter(fmt, state)
    return [splitter.feed(piece) for piece in pieces] + [splitter.finish()]


@pytest.mark.parametrize("fmt, state, text, expected", [
    (QWEN3, "start", "<think>\nLet me see.\n</think>\n\nHello!", ("Let me see.", "Hello!")),
    (QWEN3, "start", "Hello <think>x</think>", (None, "Hello <think>x</think>")),
    (QWEN3, "start", "<think>cut short", ("cut short", None)),
    (QWEN3, "content", "<think>x</think>y", (None, "<think>x</think>y")),
    (QWEN3, "reasoning", "a</think>b", ("a", "b")),
    (R1, "start", "no tag here</think>\n\nanswer", ("no tag here", "answer")),
    (R1, "start", "<think>tagged</think>answer", ("tagged", "answer")),
    (R1, "start", "never ended", ("never ended", None)),
    (R1, "content", "plain answer", (None, "plain answer")),
    (R1, "start", "<th", ("<th", None)),
    (QWEN3, "start", "<th", (None, "<th")),
    (QWEN3, "start", "", (None, None)),
    (QWEN3, "start", "<think>a</think>b</think>c", ("a", "b</think>c")),
    (HARMONY, "start", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
                       "<|message|>Hello!", ("Think.", "Hello!")),
    (HARMONY, "start", "<|channel|>final<|message|>Straight to it.", (None, "Straight to it.")),
    (HARMONY, "start", "<|channel|>analysis<|message|>cut short", ("cut short", None)),
    (HARMONY, "start", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary"
                       "<|message|>b", ("a", "<|channel|>commentary<|message|>b")),
    (HARMONY, "reasoning", "opened<|end|><|channel|>final<|message|>x", ("opened", "x")),
])
def test_whole_answers(fmt, state, text, expected):
    assert ReasoningSplitter(fmt, state).split(text) == expected
    assert reference_split(fmt, state, text) == expected


ALPHABET = ["<think>", "</think>", "<", "</", "</th", "think", ">", "<t", "\n", " ", "a", "b", "{"]
HARMONY_ALPHABET = ["<|channel|>analysis<|message|>", "<|channel|>", "analysis", "final", "<|message|>",
                    "<|end|>", "<|start|>", "assistant", "<|start|>assistant", "<|channel|>final<|message|>",
                    "<|", "|>", "\n", " ", "a", "{"]


@settings(max_examples=600, deadline=None)
@given(data=st.data(), cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=8),
       fmt=st.sampled_from([QWEN3, R1, HARMONY]), state=st.sampled_from(["start", "reasoning", "content"]))
def test_streamed_pieces_concatenate_to_the_whole_split(data, cuts, fmt, state):
    """However the answer is cut, the streamed pieces join to the whole answer's split, and no
    reasoning piece comes after a content piece."""
    alphabet = HARMONY_ALPHABET if fmt is HARMONY else ALPHABET
    text = "".join(data.draw(st.lists(st.sampled_from(alphabet), max_size=14)))
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out = streamed(fmt, state, pieces)
    reasoning = "".join(r for r, _ in out) or None
    content = "".join(c for _, c in out) or None
    assert (reasoning, content) == reference_split(fmt, state, text)
    assert ReasoningSplitter(fmt, state).split(text) == (reasoning, content)
    first_content = next((i for i, (_, c) in enumerate(out) if c), len(out))
    assert not any(r for r, _ in out[first_content + 1:])


def test_held_back_text_is_only_a_possible_marker():
    """A piece that cannot be part of a marker goes out at once (streaming stays live)."""
    splitter = ReasoningSplitter(QWEN3, "start")
    assert splitter.feed("<thi") == ("", "")  # may still be <think>
    assert splitter.feed("nk>Step one") == ("Step one", "")
    assert splitter.feed(", two </th") == (", two", "")  # the space and "</th" wait
    assert splitter.feed("ink>\n\n") == ("", "")
    assert splitter.feed("Done") == ("", "Done")
    assert splitter.finish() == ("", "")


@pytest.mark.parametrize("prompt, state", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "start"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "content"),
    ("<｜Assistant｜><think>\n", "reasoning"),
    ("<think>old</think> user asks again\nassistant:", "start"),
])
def test_the_prompt_end_decides_where_the_answer_starts(prompt, state):
    assert prompt_state(QWEN3, prompt) == state


def test_unknown_parser_is_one_line():
    known = "known: qwen3, deepseek_r1, gpt_oss, openai_gptoss"
    with pytest.raises(ValueError, match=f"unknown reasoning parser 'qwen9'; {known}"):
        reasoning_format("qwen9")


def test_vllms_name_for_the_harmony_parser_is_the_same_parser():
    assert reasoning_format("openai_gptoss") is reasoning_format("gpt_oss") is HARMONY
