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
"""

from __future__ import annotations

import json

import llguidance

from pagedllm.structured.spec import ReasoningPrefix

# Between the reasoning and a constrained answer (Qwen3 writes "\n\n"); bounded, so that a small
# model cannot spend its tokens on newlines.
_GAP = r"/[ \t\r\n]{0,8}/"
_REGEX_SPECIALS = set("\\.+*?()|[]{}^$#&-~/")


def after_reasoning(prefix: ReasoningPrefix, answer: str | None) -> str:
    """The llguidance grammar of reasoning then answer. answer: the constraint's own grammar as
    llguidance takes it (a TopLevelGrammar JSON with one grammar, or Lark text); None: any text."""
    if answer is None:
        return llguidance.LLMatcher.grammar_from_regex("(?s:.*)")
    think = f"think[lazy]: /(?s:.*){_regex(prefix.end)}/"
    if prefix.mode == "open":
        start = f"start: think {_GAP} @answer"
    else:
        start = f"start: ({_literal(prefix.start)} think {_GAP})? @answer"
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
