"""Chat templates: compiled in a sandbox, checked when loaded, rendered under a budget.

A chat template is Jinja code that comes with a model (or --chat-template). Jinja's sandbox limits
what it can reach, not how much work it does: a nested `range(100000)` loop runs for hours, and
`'a' * 400000000` allocates 400 MB. So every render here has a budget: a deadline, checked at
each loop iteration and each call the template makes (RENDER_TIMEOUT_S), and a bound on the
characters it may produce, checked where text grows (string repetition, concatenation with `~`
before its parts are joined, the widths and precisions of `%`, `format` and str.format, filters
that pad or repeat, the output itself). Past it, rendering stops with TemplateTimeout (the
template's fault: the server answers 500) or TemplateTooLong (a ValueError: the conversation
renders longer than the model's context could hold).

A template is compiled and test-rendered once on a one-message conversation when the engine
starts (check_chat_template): a syntax error or a template that cannot render a plain
conversation stops start-up with one line, instead of failing every chat request later as if
the client were at fault.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIMEOUT_S = 2.0
# Characters a render may produce when the caller gives no bound of its own.
MAX_RENDER_CHARS = 1 << 24
# A one-message conversation every chat template must render (the start-up check).
_PROBE = [{"role": "user", "content": "Hello"}]
_LOOP_GUARD = "__pagedllm_loop_budget"
_CONCAT_GUARD = "__pagedllm_concat_budget"
# The numbers of a printf-style conversion (%10s, %.5f, %-08.3d): its width and precision.
_PERCENT_SPEC = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?")
# A str.format field's spec, after the colon ({:>10}, {0:.5f}).
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


class TemplateTimeout(RuntimeError):
    """The template did not finish within its time budget: a fault of the template."""


class TemplateTooLong(ValueError):
    """The render passed its output bound: the conversation is too long for the model."""


class _Budget:
    def __init__(self, timeout_s: float, max_chars: int) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.max_chars = max_chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateTimeout(f"the chat template did not finish rendering within "
                                  f"{self.timeout_s:g} s (a loop that runs too long?)")

    def check_size(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple)) and len(value) > self.max_chars:
            raise TemplateTooLong(f"the chat template built a value of {len(value)} items, more "
                                  f"than its {self.max_chars}-character budget")
        return value

    def check_count(self, value: Any) -> None:
        """A count (a repeat, a width) that would build more than the output may hold."""
        if isinstance(value, int) and not isinstance(value, bool) and value > self.max_chars:
            raise TemplateTooLong(f"the chat template asks for {value} characters, more than its "
                                  f"{self.max_chars}-character budget")

    def check_format(self, text: str, spec: re.Pattern) -> None:
        """The widths and precisions in a format string (spec: _PERCENT_SPEC or _FORMAT_SPEC)."""
        for match in spec.finditer(text):
            for number in re.findall(r"\d+", "".join(g or "" for g in match.groups())):
                self.check_count(int(number))


_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _current() -> _Budget:
    budget = _budget.get(None)
    if budget is None:  # rendered outside render_chat_template: the default budget from now
        budget = _Budget(RENDER_TIMEOUT_S, MAX_RENDER_CHARS)
        _budget.set(budget)
    return budget


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, counting the work a template does (the budget of the render in progress)."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _current()
        budget.tick()
        if operator == "*":
            if isinstance(left, (str, list, tuple)):
                budget.check_count(len(left) * right if isinstance(right, int) else 0)
            if isinstance(right, (str, list, tuple)):
                budget.check_count(len(right) * left if isinstance(left, int) else 0)
        elif operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateTooLong(f"the chat template raises a number to the power {right}")
        elif operator == "%" and isinstance(left, str):
            budget.check_format(left, _PERCENT_SPEC)
        return budget.check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        budget = _current()
        budget.tick()
        if isinstance(text := getattr(__obj, "__self__", None), str):  # 'a'.ljust(n), 'a'.center(n), ...
            for value in (*args, *kwargs.values()):
                budget.check_count(value)
            if getattr(__obj, "__name__", "") in ("format", "format_map"):  # '{:>999999999}'.format(x)
                budget.check_format(text, _FORMAT_SPEC)
        return budget.check_size(super().call(__context, __obj, *args, **kwargs))


def _bounded_filter(function):
    """A filter whose numeric arguments (widths, repeats) and result are within the budget."""

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _current()
        budget.tick()
        for value in (*args[1:], *kwargs.values()):
            budget.check_count(value)
        if function.__name__ == "do_format" and args and isinstance(args[0], str):  # '%9999s' | format
            budget.check_format(args[0], _PERCENT_SPEC)
        return budget.check_size(function(*args, **kwargs))

    return bounded


def _concat_budget(parts: list) -> str:
    """`a ~ b ~ ...`: the parts' lengths checked before they are joined (a chain of `~` built a
    1 GiB string in one join, each part within the budget)."""
    budget = _current()
    budget.tick()
    texts = [str(part) for part in parts]
    budget.check_count(sum(map(len, texts)))
    return "".join(texts)


def _loop_budget(iterable: Iterable) -> Iterator:
    """Every loop of a template iterates through this: the deadline checked at each item."""
    budget = _current()
    for item in iterable:
        budget.tick()
        yield item


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment() -> _BoundedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals[_LOOP_GUARD] = _loop_budget
    env.globals[_CONCAT_GUARD] = _concat_budget
    return env


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in the bounded sandbox, every loop's iterable passed through the
    loop budget and every `~` through the concatenation budget (compiled once per distinct text);
    a syntax error raises
    jinja2.TemplateSyntaxError."""
    env = _environment()
    tree = env.parse(source)
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.Name(_LOOP_GUARD, "load", lineno=loop.lineno), [loop.iter], [],
                               None, None, lineno=loop.lineno)
    for concat in tree.find_all(nodes.Concat):  # its parts go through the concatenation budget
        concat.nodes = [nodes.Call(nodes.Name(_CONCAT_GUARD, "load", lineno=concat.lineno),
                                   [nodes.List(concat.nodes, lineno=concat.lineno)], [], None, None,
                                   lineno=concat.lineno)]
    return env.from_string(tree)


def render_chat_template(template: jinja2.Template, *, timeout_s: float = RENDER_TIMEOUT_S,
                         max_chars: int = MAX_RENDER_CHARS, **context: Any) -> str:
    """The template rendered with context, within timeout_s and max_chars (TemplateTimeout,
    TemplateTooLong past them)."""
    budget = _Budget(timeout_s, max_chars)
    token = _budget.set(budget)
    try:
        parts, size = [], 0
        for part in template.generate(**context):
            size += len(part)
            if size > max_chars:
                raise TemplateTooLong(f"the chat template's output passed {max_chars} characters, "
                                      "more than the model's context can hold")
            parts.append(part)
        return "".join(parts)
    finally:
        _budget.reset(token)


def check_chat_template(source: str, render, what: str) -> None:
    """ValueError in one line unless the template compiles and renders a one-message conversation.
    render(messages) renders it as requests will be; what names the template in the message."""
    try:
        compile_chat_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{what} does not compile: line {exc.lineno}: {exc.message}") from None
    try:
        render(_PROBE)
    except Exception as exc:  # noqa: BLE001 (any failure of the template is reported the same)
        raise ValueError(f"{what} fails on a one-message conversation: "
                         f"{type(exc).__name__}: {exc}") from None


def load_chat_template(value: str) -> str:
    """A chat template given as a file's path or as the template itself (vLLM's --chat-template),
    checked to compile."""
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        template = path.read_text(encoding="utf-8")
    elif any(mark in value for mark in ("{{", "{%")):
        template = value
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    try:
        compile_chat_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {value[:80]!r}: line {exc.lineno}: {exc.message}") from None
    return template


def content_spans(text: str, messages: list[dict[str, Any]],
                  render: Callable[[list], str] | None = None) -> list[tuple[int, int]]:
    """Where each message's text sits in the rendered conversation, in order: (start, end)
    character spans, for the texts found as written (or stripped, as templates often trim them).
    A text part list counts part by part.

    render(messages) renders as `text` was rendered: the spans are then read from a render whose
    texts are placeholders (_placed_spans), so a text that also occurs earlier in the prompt (a
    message that is the template's own end-of-turn marker, say) is found where the message put
    it, not at the earlier occurrence, whose special tokens would then act. A template whose
    output depends on the texts themselves falls back to searching, in order."""
    if render is not None:
        placed = _placed_spans(text, messages, render)
        if placed is not None:
            return placed
    spans, at = [], 0
    for message in messages:
        for part in message_texts(message):
            if not isinstance(part, str) or not part.strip():
                continue
            for candidate in (part, part.strip()):
                found = text.find(candidate, at)
                if found != -1:
                    spans.append((found, found + len(candidate)))
                    at = found + len(candidate)
                    break
    return spans


def message_texts(message) -> list:
    """A chat message's texts: its content, or its text parts' (other values as they are)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return [content]
    return [p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) else []


_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: no template writes them
_PLACEHOLDERS = re.compile("\ue000(\\d+)\ue001")


def _placed_spans(text: str, messages: list, render: Callable[[list], str]) -> list[tuple[int, int]] | None:
    """The spans of the texts in `text`, read off a render whose texts are numbered placeholders:
    each placeholder once, in order, and `text` that render with each placeholder replaced by its
    text (as written or trimmed); None where that does not hold."""
    texts: list[str] = []

    def placeholder(value):
        if isinstance(value, str):
            texts.append(value)
            return _PLACEHOLDER.format(len(texts) - 1)
        return value

    skeleton_messages = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):
            content = [{**p, "text": placeholder(p.get("text"))} if isinstance(p, dict) else p
                       for p in content]
        skeleton_messages.append({**message, "content": placeholder(content)})
    try:
        skeleton = render(skeleton_messages)
    except Exception:  # noqa: BLE001 (a template that refuses placeholders: search instead)
        return None
    pieces = _PLACEHOLDERS.split(skeleton)  # literal, index, literal, index, ..., literal
    indices = [int(i) for i in pieces[1::2]]
    if indices != list(range(len(texts))) or not text.startswith(pieces[0]):
        return None
    spans, at = [], len(pieces[0])
    for index, literal in zip(indices, pieces[2::2]):
        value = texts[index]
        for candidate in dict.fromkeys((value, value.strip(), value.lstrip(), value.rstrip())):
            if text.startswith(candidate, at) and text.startswith(literal, at + len(candidate)):
                break
        else:
            return None
        if candidate.strip():
            spans.append((at, at + len(candidate)))
        at += len(candidate) + len(literal)
    return spans if at == len(text) else None
