"""A constraint applied after a thinking model's reasoning: the llguidance grammar that lets the
reasoning through as free text, then holds the answer to the request's constraint.

vLLM applies a request's grammar only once the reasoning parser saw the end marker; here the
reasoning is part of the grammar instead, so the engine needs no notion of reasoning at all:

    start: "<think>" think "</think>" WS @answer        (mode "optional": the block may be left out)
    think[stop="</think>", max_tokens=BUDGET]: /(?s:.*)/
    answer: the request's own grammar (JSON schema, regex, choice, GBNF/Lark), a sub-grammar

`think` is a lazy lexeme ending at the first end marker (llguidance's stop=); the literal end
marker after it is the same text again, which llguidance merges with the stop (its "outer stop"
pattern: nothing is backtracked). A budget is the lexeme's max_tokens: once the reasoning has
taken that many tokens (the end marker counted when the model writes it), the lexeme ends and
the literal end marker is forced. A model caught halfway through writing the marker in several
tokens when the budget runs out gets the whole marker again after its partial one (a reasoning
that ends in "</th"); where the marker is one token (Qwen3, DeepSeek-R1) that cannot happen.

An answer of any text (a budget with no constraint, kind "text") that may skip the reasoning
must not start with the start marker, or the parser would keep both readings of "<think>..."
alive and the budget would never bind.
"""

from __future__ import annotations

import json

from pagedllm.structured.spec import ReasoningPrefix

# Between the reasoning and a constrained answer (Qwen3 writes "\n\n"); bounded, so that a small
# model cannot spend its whole budget on newlines.
_GAP = r"/[ \t\r\n]{0,8}/"
_REGEX_SPECIALS = set("\\.+*?()|[]{}^$#&-~/")


def after_reasoning(prefix: ReasoningPrefix, answer: str | None) -> str:
    """The llguidance grammar (TopLevelGrammar JSON) of reasoning then answer. answer: the
    constraint's own grammar as llguidance takes it (a TopLevelGrammar JSON with one grammar, or
    Lark text); None: any text."""
    budget = f", max_tokens={prefix.budget}" if prefix.budget is not None else ""
    end = _literal(prefix.end)
    block = f"think {end}" if prefix.mode == "open" else f"{_literal(prefix.start)} think {end}"
    rules = [f"think[stop={end}{budget}]: /(?s:.*)/"]
    if answer is None:
        if prefix.mode == "open":
            rules.insert(0, f"start: {block} TEXT")
        else:
            rules.insert(0, f"start: {block} TEXT | NOT_OPENED")
            rules.append(f"NOT_OPENED: /(?s:.*)/ & ~/{_regex(prefix.start)}(?s:.*)/")
        rules.append("TEXT: /(?s:.*)/")
        return json.dumps({"grammars": [{"lark_grammar": "\n".join(rules)}]})
    if prefix.mode == "open":
        rules.insert(0, f"start: {block} {_GAP} @answer")
    else:
        rules.insert(0, f"start: ({block} {_GAP})? @answer")
    return json.dumps({"grammars": [{"lark_grammar": "\n".join(rules)}, _named(answer, "answer")]})


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
