"""A constraint applied after a thinking model's reasoning: the llguidance grammar that lets the
reasoning through as free text, then holds the answer to the request's constraint.

vLLM applies a request's grammar only once the reasoning parser saw the end marker; here the
reasoning is part of the grammar instead, so the engine needs no notion of reasoning at all:

    start: ("<think>" think GAP)? @answer     (mode "optional"; mode "open": think GAP @answer)
    think[lazy]: /(?s:.*)<\\/think>/         (any text up to the first end marker, which it holds)
    answer: the request's own grammar (JSON schema, regex, choice, GBNF/Lark), a sub-grammar

The thinking budget is not in the grammar: llguidance's max_tokens ends a lexeme without writing
its end (the answer would follow an unclosed reasoning), and its stop= form, which does force the
marker, panics inside llguidance when a mask is asked for halfway through a marker written in
several tokens (llguidance 1.9.1, and the panic poisons the compiled grammar for every later
request). The budget is counted by the matcher instead (reasoning_budget.py), which forces the
marker's tokens itself; this grammar takes them as reasoning text like any other.

An answer of any text (a budget with no constraint, kind "text") is just any text: the budget
matcher alone gives it its shape.

Special tokens (gpt-oss's Harmony: ReasoningPrefix.special_tokens) are no text to llguidance: a
regex never matches them. Their grammar names each marker piece that is one as a token, and the
reasoning is any text ended by the end token (which no text can hold, so no lazy lexeme is
needed); the content headers come each or not, in order:

    start: (<|channel|> "analysis" <|message|> think)? (<|start|> "assistant")?
           (<|channel|> "final" <|message|>)? GAP @answer
    think: /(?s:.*)/ <|end|>

and an answer of any text is text and those special tokens in any order (a commentary channel's
tool call among them). The budget matcher needs nothing apart: llguidance decodes a special token
to its text and tokenizes the text back to it.
"""

from __future__ import annotations

import json
import re

import llguidance

from pagedllm.structured.spec import ReasoningPrefix

# Between the reasoning and a constrained answer (Qwen3 writes "\n\n"); bounded, so that a small
# model cannot spend its tokens on newlines.
_GAP = r"/[ \t\r\n]{0,8}/"
_REGEX_SPECIALS = set("\\.+*?()|[]{}^$#&-~/")


def after_reasoning(prefix: ReasoningPrefix, answer: str | None) -> str:
    """The llguidance grammar of reasoning then answer. answer: the constraint's own grammar as
    llguidance takes it (a TopLevelGrammar JSON with one grammar, or Lark text); None: any text."""
    if prefix.special_tokens:
        return _after_special_tokens(prefix, answer)
    if answer is None:
        return llguidance.LLMatcher.grammar_from_regex("(?s:.*)")
    think = f"think[lazy]: /(?s:.*){_regex(prefix.end)}/"
    if prefix.mode == "open":
        start = f"start: think {_GAP} @answer"
    else:
        start = f"start: ({_literal(prefix.start)} think {_GAP})? @answer"
    return json.dumps({"grammars": [{"lark_grammar": f"{start}\n{think}"}, _named(answer, "answer")]})


def _after_special_tokens(prefix: ReasoningPrefix, answer: str | None) -> str:
    """after_reasoning where the markers hold special tokens (see the module's docstring)."""
    def tokens(marker: str) -> str:  # the special tokens as tokens, the text between as literals
        pieces = re.split(f"({'|'.join(map(re.escape, prefix.special_tokens))})", marker)
        return " ".join(p if p in prefix.special_tokens else _literal(p) for p in pieces if p)

    think = f"think: /(?s:.*)/ {tokens(prefix.end)}"
    opening = "think" if prefix.mode == "open" else f"({tokens(prefix.start)} think)?"
    headers = " ".join(f"({tokens(h)})?" for h in prefix.content_headers)
    if answer is None:
        free = " | ".join(("/(?s:.+)/", *prefix.special_tokens))
        return f"start: {opening} {headers} free\nfree: ({free})*\n{think}"
    start = f"start: {opening} {headers} {_GAP} @answer"
    return json.dumps({"grammars": [{"lark_grammar": f"{start}\n{think}"}, _named(answer, "answer")]})


def _named(grammar: str, name: str) -> dict:
    """One grammar of llguidance's, as a named entry of a TopLevelGrammar."""
    if grammar.lstrip().startswith("{"):
        grammars = json.loads(grammar)["grammars"]
        if len(grammars) != 1:
            raise ValueError(f"a constraint after reasoning must be one grammar; got {len(grammars)}")
        entry = dict(grammars[0])
    else:
        entry = {"lark_grammar": grammar}
    entry["name"] = name
    return entry


def _literal(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    """text as a regex matching itself, inside /.../."""
    return "".join(f"\\{c}" if c in _REGEX_SPECIALS else c for c in text)
