"""What a request constrains its output to, read from every spelling a client may use.

A GrammarSpec is plain, hashable data (a kind and a text): it is the key of the compiled-grammar
cache and what crosses from the API process to the engine core. Every request form is turned into
one here, and every check that needs no tokenizer happens here, so bad input fails before it
reaches the compiler:

- OpenAI `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}};
- vLLM `structured_outputs` (also offline `SamplingParams(structured_outputs=...)`): exactly one
  of "json" (a schema, as an object or its JSON text), "regex", "choice" (a list of strings),
  "grammar" (GBNF as llama.cpp and vLLM write it, or Lark) or "json_object": true, plus the
  optional "disable_any_whitespace";
- vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields.

Size bounds: a compile or a mask step is work proportional to the spec, so the spec is bounded
before anything is built (text size, schema nesting, counted repetitions; see the constants).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

# "text": any text; only with a reasoning prefix (a thinking budget with no constraint on the
# answer), never from a request's constraint fields.
GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "text"]
# How JSON output may be spaced: "spaced" is json.dumps' own ", " and ": " (what models saw most
# in training), "compact" is "," and ":", "flexible" allows any whitespace between tokens (the
# JSON standard; a small model may then spend its whole budget on newlines).
JsonWhitespace = Literal["spaced", "compact", "flexible"]

MAX_SPEC_CHARS = 64 * 1024  # a schema's JSON text, a regex, a grammar, or all choices together
MAX_SCHEMA_DEPTH = 32  # nesting of objects and arrays in a schema document
MAX_CHOICES = 1024
# A counted repetition of a literal (a{20000}) makes every token's mask walk the whole literal:
# 25 ms a step at 20,000 and 250 ms at 200,000 with SmolLM2's vocabulary, measured. Character
# classes ([a-z]{100000}) and JSON lengths (maxLength) are cheap and not limited by this.
MAX_REPEAT_COUNT = 1000
# Nested counted repetitions multiply: (a{1000}){400} is a literal of 400,000, whose masks took
# 1.3 s a step (issue 32, finding 3; SmolLM2's vocabulary, measured: the mask's cost follows the
# product, 23 ms at (a{1000}){10}, 0.3 ms at a{1000}). The product along any nesting is bounded
# like one count, so no grammar's mask makes everyone's steps slower.
MAX_REPEAT_PRODUCT = MAX_REPEAT_COUNT

_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# A special token as llguidance's grammars name one (ReasoningPrefix.special_tokens go into them).
SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_STRUCTURED_OUTPUT_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                            "grammar": "grammar", "json_object": "json_object"}
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


@dataclass(frozen=True)
class ReasoningPrefix:
    """The reasoning a thinking model writes before the constrained answer (vLLM's rule: the
    grammar starts where the reasoning ends). The reasoning is free text up to the end marker;
    with a budget, after that many tokens (the end marker counted when the model writes it) the
    end marker is forced. mode "open": the answer starts inside the reasoning (the prompt opened
    it, or the parser counts unopened text as reasoning); "optional": the answer may open it
    with the start marker, or go straight to the constrained part. content_headers: markers
    the model may write before the constrained part, each or not, in order (gpt-oss's final
    channel header). special_tokens: special tokens of the vocabulary (gpt-oss's Harmony) that
    the markers are made of and an unconstrained answer may hold: a grammar names them as tokens,
    never as text."""

    start: str = "<think>"
    end: str = "</think>"
    mode: Literal["open", "optional"] = "optional"
    budget: int | None = None
    content_headers: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, marker in [("start", self.start), ("end", self.end),
                             *(("content header", h) for h in self.content_headers),
                             *(("special token", t) for t in self.special_tokens)]:
            if not isinstance(marker, str) or not marker or len(marker) > 64:
                raise ValueError(f"the reasoning {name} marker must be 1-64 characters; got {_short(marker)}")
        for token in self.special_tokens:
            if not SPECIAL_TOKEN.fullmatch(token):
                raise ValueError(f"a reasoning special token must be written <|name|>; got {_short(token)}")
        if self.mode not in ("open", "optional"):
            raise ValueError(f"reasoning mode must be 'open' or 'optional'; got {_short(self.mode)}")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 1):
            raise ValueError(f"thinking_token_budget must be a positive integer; got {_short(self.budget)}")


@dataclass(frozen=True)
class GrammarSpec:
    """A checked constraint. `text` is the schema's compact JSON (key order kept: it is the order
    properties are written in), the regex, the choices as a JSON list, or the grammar; empty for
    json_object and text. `whitespace` applies to the JSON kinds only. `reasoning`: the
    constraint applies after the model's reasoning (pagedllm.structured.reasoning_grammar)."""

    kind: GrammarKind
    text: str = ""
    whitespace: JsonWhitespace = "spaced"
    reasoning: ReasoningPrefix | None = None

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str,
                    whitespace: JsonWhitespace = "spaced") -> GrammarSpec:
        if isinstance(schema, str):
            schema = _parse_json(schema, "the JSON schema")
        if not isinstance(schema, Mapping | bool):
            raise ValueError(f"a JSON schema must be an object or a boolean; got {_type_name(schema)}")
        _check_depth(schema)
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        _check_size(text, "the JSON schema")
        _check_patterns(schema)
        return cls("json_schema", text, _check_whitespace(whitespace))

    @classmethod
    def json_object(cls, whitespace: JsonWhitespace = "spaced") -> GrammarSpec:
        return cls("json_object", "", _check_whitespace(whitespace))

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        _check_text(pattern, "regex")
        _check_repeats(pattern, "the regex")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> GrammarSpec:
        if not isinstance(choices, list | tuple) or not choices:
            raise ValueError(f"choice must be a non-empty list of strings; got {_short(choices)}")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"choice allows at most {MAX_CHOICES} strings; got {len(choices)}")
        for choice in choices:
            if not isinstance(choice, str) or not choice:
                raise ValueError(f"each choice must be a non-empty string; got {_short(choice)}")
        text = json.dumps(list(choices), ensure_ascii=False)
        _check_size(text, "the choices")
        return cls("choice", text)

    @classmethod
    def grammar(cls, grammar: str) -> GrammarSpec:
        _check_text(grammar, "grammar")
        _check_repeats(grammar, "the grammar")
        return cls("grammar", grammar)

    @classmethod
    def any_text(cls, reasoning: ReasoningPrefix) -> GrammarSpec:
        """Any answer after the reasoning: what a thinking budget alone constrains."""
        return cls("text", reasoning=reasoning)

    def after_reasoning(self, reasoning: ReasoningPrefix) -> GrammarSpec:
        """This constraint applied to the answer after the reasoning."""
        return replace(self, reasoning=reasoning)

    def describe(self) -> str:
        """A short name for logs and error messages."""
        name = self.kind if not self.text else f"{self.kind} {_short(self.text)}"
        return name if self.reasoning is None else f"{name} after reasoning"


def spec_from_request(
    *,
    response_format: Mapping[str, Any] | None = None,
    structured_outputs: Mapping[str, Any] | GrammarSpec | None = None,
    guided_json: Any = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
) -> GrammarSpec | None:
    """The one constraint a request asks for (None: free text). Two at once are a ValueError:
    which to obey would be a guess."""
    guided = {name: value for name, value in (
        ("guided_json", guided_json), ("guided_regex", guided_regex),
        ("guided_choice", guided_choice), ("guided_grammar", guided_grammar)) if value is not None}
    given = [name for name, value in (("response_format", response_format),
                                      ("structured_outputs", structured_outputs)) if value is not None]
    given += list(guided)
    if response_format is not None and _response_format_type(response_format) == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise ValueError(f"a request may ask for one output constraint; got {', '.join(given)}")
    if not given:
        return None
    if given[0] == "response_format":
        return spec_from_response_format(response_format)
    if given[0] == "structured_outputs":
        if isinstance(structured_outputs, GrammarSpec):
            return structured_outputs
        return spec_from_structured_outputs(structured_outputs)
    name, value = next(iter(guided.items()))
    return _spec_of_kind(_GUIDED_FIELDS[name], value, name, "spaced")


def spec_from_response_format(response_format: Mapping[str, Any]) -> GrammarSpec | None:
    """OpenAI's response_format. A json_schema without a schema asks for any JSON object."""
    kind = _response_format_type(response_format)
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema'; "
                         f"got {_short(kind)}")
    body = response_format.get("json_schema")
    if not isinstance(body, Mapping):
        raise ValueError("response_format.json_schema must be an object with a name and a schema")
    name = body.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValueError("response_format.json_schema.name must be 1-64 letters, digits, '_' or "
                         f"'-'; got {_short(name)}")
    schema = body.get("schema")
    if schema is None:
        return GrammarSpec.json_object()
    return _with_context(GrammarSpec.json_schema, schema, "response_format.json_schema.schema")


def spec_from_structured_outputs(params: Mapping[str, Any]) -> GrammarSpec:
    """vLLM's structured_outputs object: exactly one constraint, and how to space JSON."""
    if not isinstance(params, Mapping):
        raise ValueError(f"structured_outputs must be an object; got {_type_name(params)}")
    allowed = set(_STRUCTURED_OUTPUT_KINDS) | {"disable_any_whitespace"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        named = ", ".join(str(key) if len(str(key)) <= 80 else str(key)[:77] + "..."
                          for key in unknown[:5])  # a key may be megabytes
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(f"structured_outputs does not support {named}{more}; "
                         f"allowed: {', '.join(sorted(allowed))}")
    chosen = [key for key in _STRUCTURED_OUTPUT_KINDS
              if params.get(key) is not None and params.get(key) is not False]
    if len(chosen) != 1:
        raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                         f"json_object; got {', '.join(chosen) or 'none'}")
    whitespace = _whitespace_option(params.get("disable_any_whitespace"))
    key = chosen[0]
    return _spec_of_kind(key, params[key], f"structured_outputs.{key}", whitespace)


def _spec_of_kind(key: str, value: Any, where: str, whitespace: JsonWhitespace) -> GrammarSpec:
    if key == "json":
        return _with_context(GrammarSpec.json_schema, value, where, whitespace)
    if key == "json_object":
        if value is not True:
            raise ValueError(f"{where} must be true or absent; got {_short(value)}")
        return GrammarSpec.json_object(whitespace)
    for name, build in (("regex", GrammarSpec.regex), ("grammar", GrammarSpec.grammar)):
        if key == name:
            if not isinstance(value, str):
                raise ValueError(f"{where} must be a string; got {_type_name(value)}")
            return _with_context(build, value, where)
    return _with_context(GrammarSpec.choice, value, where)


def _with_context(build, value, where: str, *args) -> GrammarSpec:
    """Prefix the field's name to what went wrong inside it."""
    try:
        return build(value, *args)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _response_format_type(response_format: Mapping[str, Any]) -> Any:
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format must be an object; got {_type_name(response_format)}")
    return response_format.get("type")


def _whitespace_option(disable_any_whitespace: Any) -> JsonWhitespace:
    if disable_any_whitespace is None:
        return "spaced"
    if not isinstance(disable_any_whitespace, bool):
        raise ValueError("structured_outputs.disable_any_whitespace must be a boolean; "
                         f"got {_short(disable_any_whitespace)}")
    return "compact" if disable_any_whitespace else "flexible"


def _check_whitespace(whitespace: str) -> JsonWhitespace:
    if whitespace not in ("spaced", "compact", "flexible"):
        raise ValueError(f"whitespace must be 'spaced', 'compact' or 'flexible'; got {_short(whitespace)}")
    return whitespace


def _check_text(text: Any, what: str) -> None:
    if not isinstance(text, str) or not text:
        raise ValueError(f"the {what} must be a non-empty string; got {_short(text)}")
    _check_size(text, f"the {what}")


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{what} is {len(text)} characters; the limit is {MAX_SPEC_CHARS}")


def _check_depth(schema: Any) -> None:
    """Iterative, so a document nested past Python's recursion limit fails cleanly too."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, Mapping | list))


def _check_patterns(schema: Any) -> None:
    """Counted repetitions in the schema's regexes: `pattern` values, `patternProperties` keys."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, Mapping):
            continue
        if isinstance(node.get("pattern"), str):
            _check_repeats(node["pattern"], "a pattern in the JSON schema")
        if isinstance(node.get("patternProperties"), Mapping):
            for pattern in node["patternProperties"]:
                _check_repeats(pattern, "a patternProperties key in the JSON schema")
        stack.extend(node.values())


def _check_repeats(text: str, what: str) -> None:
    for match in _REPEAT.finditer(text):
        counts = [int(n) for n in match.groups() if n]
        if max(counts) > MAX_REPEAT_COUNT:
            raise ValueError(f"{what} repeats {match.group(0)} times; counted repetitions are "
                             f"limited to {MAX_REPEAT_COUNT}")
    product = _max_repeat_product(text)
    if product > MAX_REPEAT_PRODUCT:
        raise ValueError(f"{what} nests counted repetitions that repeat {product} times in all; "
                         f"nested counts multiply, and their product is limited to "
                         f"{MAX_REPEAT_PRODUCT} (each step's mask walks every repetition)")


def _max_repeat_product(text: str) -> int:
    """The largest product of counted repetitions ({n} or {n,m}, by their upper count) along any
    nesting of groups in a regex: (a{10}|b){20} gives 200. A scan, not a parser: escapes and
    character classes are skipped, unbalanced text is judged as far as it goes (llguidance
    refuses what does not parse)."""
    groups = [1]  # the largest product inside each open group
    atom = 1  # the product of the atom just read (a group's when it just closed)
    i = 0
    while i < len(text):
        char = text[i]
        repeat = _REPEAT.match(text, i) if char == "{" else None
        if repeat is not None:
            count = max(int(n) for n in repeat.groups() if n)
            groups[-1] = max(groups[-1], atom * count)
            atom, i = 1, repeat.end()
            continue
        groups[-1] = max(groups[-1], atom)
        atom = 1
        if char == "\\":
            i += 1
        elif char == "[":
            i = _class_end(text, i)
        elif char == "(":
            groups.append(1)
        elif char == ")" and len(groups) > 1:
            atom = groups.pop()
        i += 1
    return max(max(groups), atom)


def _class_end(text: str, start: int) -> int:
    """The index of the ']' that closes the character class opened at start (or the end)."""
    i = start + 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":  # a ']' first is a literal
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i


def _parse_json(text: str, what: str) -> Any:
    _check_size(text, what)
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
