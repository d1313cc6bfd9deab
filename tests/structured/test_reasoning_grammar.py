"""A constraint after the reasoning (structured/reasoning_grammar.py) and a thinking budget
(structured/reasoning_budget.py), walked byte by byte with the tiny byte tokenizer (one token per
byte, so a budget of N tokens is N bytes): the reasoning is free, the answer is held to the
constraint, a budget forces the end marker."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.core_channel import AddRequest
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.spec import GrammarSpec, ReasoningPrefix
from tests.server.scripted_core import tokens_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
JSON = GrammarSpec.json_schema(SCHEMA)
EOS = 257


def walk(compiler, spec: GrammarSpec, text: str):
    """A fresh matcher for spec after text; None if the grammar refused a byte of it."""
    matcher = compiler.matcher(spec)
    return matcher if matcher.accept_tokens(list(text.encode())) else None


def next_bytes(matcher) -> set:
    return {bytes([t]).decode("latin-1") if t < 256 else t for t in matcher.allowed_token_ids()}


@pytest.mark.parametrize("mode, opening", [("optional", "<think>"), ("open", "")])
def test_free_reasoning_then_the_constrained_answer(tiny_compiler, mode, opening):
    spec = JSON.after_reasoning(ReasoningPrefix(mode=mode))
    # Braces and quotes in the reasoning: no JSON grammar would let them through from the start.
    matcher = walk(tiny_compiler, spec, opening + '\nI {think} "so"\n</think>\n\n{"a": 1}')
    assert matcher is not None and matcher.can_end
    assert walk(tiny_compiler, spec, opening + "x</think>\n\nhello") is None  # the answer is held
    assert next_bytes(walk(tiny_compiler, spec, opening + "x</think>")) >= {"{", "\n"}


def test_optional_reasoning_may_be_skipped_but_open_may_not(tiny_compiler):
    assert walk(tiny_compiler, JSON.after_reasoning(ReasoningPrefix()), '{"a": 2}').can_end
    open_spec = JSON.after_reasoning(ReasoningPrefix(mode="open"))
    assert not walk(tiny_compiler, open_spec, '{"a": 2}').can_end  # that was reasoning


@pytest.mark.parametrize("mode, opening", [("optional", "<think>"), ("open", "")])
@pytest.mark.parametrize("answer", [JSON, None])
def test_the_budget_forces_the_end_marker(tiny_compiler, mode, opening, answer):
    prefix = ReasoningPrefix(mode=mode, budget=12)
    spec = answer.after_reasoning(prefix) if answer is not None else GrammarSpec.any_text(prefix)
    assert len(next_bytes(walk(tiny_compiler, spec, opening + "x" * 11))) > 150  # still free (any UTF-8)
    at_budget = walk(tiny_compiler, spec, opening + "x" * 12)
    assert next_bytes(at_budget) == {"<"}
    forced = []
    for _ in range(len("</think>")):  # the whole marker is forced, one byte at a time
        (token,) = at_budget.allowed_token_ids()
        forced.append(token)
        assert at_budget.accept_token(token)
    assert bytes(forced) == b"</think>"
    # Within the budget the model may end its reasoning itself (the marker's tokens counted).
    assert walk(tiny_compiler, spec, opening + "xy</think>") is not None


def test_a_budget_alone_leaves_an_answer_that_skips_reasoning_free(tiny_compiler):
    spec = GrammarSpec.any_text(ReasoningPrefix(budget=4))
    matcher = walk(tiny_compiler, spec, "no reasoning here, a long plain answer")
    assert matcher is not None and matcher.can_end
    assert walk(tiny_compiler, spec, "<think>abcd").allowed_token_ids() == [ord("<")]


@pytest.mark.parametrize("answer, good, bad", [
    (GrammarSpec.regex("[0-9]+"), "42", "4x"),
    (GrammarSpec.choice(["yes", "no"]), "no", "maybe"),
    (GrammarSpec.grammar('root ::= "a" "b"+'), "abbb", "ba"),
    (GrammarSpec.json_object(), '{"k": [1]}', "[1]"),
])
def test_every_kind_of_answer_after_reasoning(tiny_compiler, answer, good, bad):
    spec = answer.after_reasoning(ReasoningPrefix())
    assert walk(tiny_compiler, spec, f"<think>r</think>{good}").can_end
    assert walk(tiny_compiler, spec, f"<think>r</think>{bad}") is None


@pytest.mark.parametrize("prefix", [ReasoningPrefix(mode="open", budget=100), ReasoningPrefix(
    "<|channel|>analysis<|message|>", "<|end|>", "optional", 9, ("<|start|>assistant",), ("<|end|>",))])
def test_specs_with_reasoning_are_plain_data_that_cross_the_channel(prefix):
    spec = JSON.after_reasoning(prefix)
    assert hash(spec) != hash(JSON) and spec != JSON and spec.describe().endswith("after reasoning")
    request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=spec), (257,), 0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(AddRequest(request)), type=AddRequest)
    assert decoded.request.sampling_params.structured_outputs == spec


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 0}, "thinking_token_budget must be a positive integer"),
    ({"budget": True}, "thinking_token_budget must be a positive integer"),
    ({"end": ""}, "the reasoning end marker must be 1-64 characters"),
    ({"mode": "maybe"}, "reasoning mode must be 'open' or 'optional'"),
    ({"content_headers": ("",)}, "the reasoning content header marker must be 1-64 characters"),
    ({"special_tokens": ('<|x|> "injected"',)}, "a reasoning special token must be written <|name|>"),
])
def test_bad_prefixes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReasoningPrefix(**kwargs)


def test_grammar_json_is_one_envelope():
    from pagedllm.structured.compiler import llguidance_grammar

    grammars = json.loads(llguidance_grammar(JSON.after_reasoning(ReasoningPrefix(budget=5))))["grammars"]
    assert [g.get("name") for g in grammars] == [None, "answer"]
    assert "think[lazy]" in grammars[0]["lark_grammar"]


def test_a_mask_halfway_through_the_marker(tiny_compiler):
    """Masks asked for at every byte of a marker written one byte at a time (where llguidance's
    stop= form panicked): the marker's next byte is allowed each time."""
    for spec in (JSON.after_reasoning(ReasoningPrefix()), JSON.after_reasoning(ReasoningPrefix(budget=50))):
        matcher = tiny_compiler.matcher(spec)
        for byte in b'<think>ab</think>\n{"a": 3}':
            assert byte in matcher.allowed_token_ids()
            assert matcher.accept_token(byte)
        assert matcher.can_end


def test_the_budget_completes_a_marker_begun_in_time(tiny_compiler):
    """Out of budget halfway through the marker: only the marker's rest is forced."""
    spec = JSON.after_reasoning(ReasoningPrefix(budget=14))
    matcher = walk(tiny_compiler, spec, "<think>" + "x" * 10 + "</th")
    assert next_bytes(matcher) == {"i"}
    assert matcher.accept_tokens(list(b"ink>")) and "{" in next_bytes(matcher)


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.sampled_from(list("ab <>/thinkx{}")), max_size=40), back=st.integers(0, 40),
       mode=st.sampled_from(["open", "optional"]))
def test_rollback_and_fork_are_replay(tiny_compiler, text, back, mode):
    """A matcher rolled back (or forked) is in the state of one that took only the kept tokens."""
    spec = GrammarSpec.any_text(ReasoningPrefix(mode=mode, budget=6))
    matcher = tiny_compiler.matcher(spec)
    taken = []
    for byte in text.encode():
        if byte not in matcher.allowed_token_ids():
            break
        assert matcher.accept_token(byte)
        taken.append(byte)
    back = min(back, len(taken))
    child = matcher.fork()
    matcher.rollback(back)
    fresh = tiny_compiler.matcher(spec)
    assert fresh.accept_tokens(taken[:len(taken) - back])
    assert matcher.allowed_token_ids() == fresh.allowed_token_ids()
    assert matcher.can_end == fresh.can_end
    replayed = tiny_compiler.matcher(spec)
    assert replayed.replay(taken)
    assert child.allowed_token_ids() == replayed.allowed_token_ids()


def test_the_batched_fill_asks_a_forcing_matcher_for_its_row(tiny_compiler):
    """llguidance's thread pool fills rows from its own matchers; a matcher forcing the end marker
    fills its row itself, and the rows equal the one-by-one fill's."""
    from pagedllm.structured.bitmask import allocate_token_bitmask
    from pagedllm.structured.matcher import BitmaskFiller

    spec = JSON.after_reasoning(ReasoningPrefix(budget=3))
    matchers = [walk(tiny_compiler, spec, "<think>" + "x" * (i % 4)) for i in range(10)]
    assert any(m.fills_own_row for m in matchers) and not all(m.fills_own_row for m in matchers)
    rows = [(m, i) for i, m in enumerate(matchers)]
    one_by_one = allocate_token_bitmask(len(rows), tiny_compiler.vocab_size)
    BitmaskFiller().fill(one_by_one, rows)
    batched = allocate_token_bitmask(len(rows), tiny_compiler.vocab_size)
    BitmaskFiller(num_threads=2).fill(batched, rows)
    assert (batched == one_by_one).all()
    assert next_bytes(matchers[3]) == {"<"}


def test_a_token_other_than_the_forced_marker_is_refused_with_a_reason(tiny_compiler):
    matcher = walk(tiny_compiler, GrammarSpec.any_text(ReasoningPrefix(budget=2)), "<think>ab")
    assert not matcher.accept_token(ord("c"))
    assert "the thinking budget is spent" in matcher.error
    matcher.reset()
    assert matcher.error is None and matcher.accept_tokens(list(b"<think>ab</think>done"))


def test_a_real_vocabulary_forces_the_whole_marker(smol_compiler, smol_tokenizer):
    """SmolLM2's BPE writes </think> in several tokens: the budget forces them all, in order, and
    the answer follows under its grammar."""
    spec = JSON.after_reasoning(ReasoningPrefix(budget=4))
    matcher = smol_compiler.matcher(spec)
    assert matcher.accept_tokens(smol_tokenizer.encode("<think> one two three four"))
    forced = []
    while matcher.fills_own_row:
        (token,) = matcher.allowed_token_ids()
        forced.append(token)
        assert matcher.accept_token(token)
    assert smol_tokenizer.decode(forced) == "</think>" and len(forced) > 1
    assert matcher.accept_tokens(smol_tokenizer.encode('{"a": 5}')) and matcher.can_end


HARMONY = {"<|start|>": 258, "<|channel|>": 259, "<|message|>": 260, "<|end|>": 261, "<|constrain|>": 262}
HARMONY_PREFIX = ReasoningPrefix("<|channel|>analysis<|message|>", "<|end|>", "optional", None,
                                 ("<|start|>assistant", "<|channel|>final<|message|>"), tuple(HARMONY))


@pytest.fixture(scope="module")
def harmony_compiler():
    """The tiny tokenizer with Harmony's markers as special tokens 258-262."""
    from tokenizers import AddedToken

    from pagedllm.structured.compiler import GrammarCompiler
    from pagedllm.text.tokenizer import Tokenizer
    from tests.model import tiny

    backend = tiny.tokenizer_backend()
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in HARMONY])
    compiler = GrammarCompiler(Tokenizer(backend, {"bos_token": tiny.BOS, "eos_token": tiny.EOS}))
    yield compiler
    compiler.close()


def harmony_tokens(text: str) -> list[int]:
    """Each marker its special token, every other character its byte."""
    return tokens_of(text, HARMONY)


def harmony_walk(compiler, spec: GrammarSpec, text: str):
    matcher = compiler.matcher(spec)
    return matcher if matcher.accept_tokens(harmony_tokens(text)) else None


@pytest.mark.parametrize("headers", [
    "<|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>", ""])
def test_special_token_markers_are_tokens_to_the_grammar(harmony_compiler, headers):
    """Harmony's analysis channel, its end token, the final channel's header (all, part or none of
    it), then the schema's answer; the markers spelled out in plain bytes are only text."""
    spec = JSON.after_reasoning(HARMONY_PREFIX)
    thought = '<|channel|>analysis<|message|>I {think} "so"<|end|>'
    assert harmony_walk(harmony_compiler, spec, thought + headers + '{"a": 1}').can_end
    assert harmony_walk(harmony_compiler, spec, thought + headers + "hello") is None
    assert harmony_walk(harmony_compiler, spec, headers + '{"a": 1}').can_end  # no analysis at all
    in_reasoning = harmony_walk(harmony_compiler, spec, "<|channel|>analysis<|message|>I think")
    assert HARMONY["<|end|>"] in in_reasoning.allowed_token_ids()
    assert HARMONY["<|start|>"] not in in_reasoning.allowed_token_ids()  # only <|end|> ends it
    spelled = in_reasoning.accept_tokens(list(b"<|end|>")) and in_reasoning.accept_tokens(list(b'{"a": 1}'))
    assert spelled and not in_reasoning.can_end  # still reasoning: the text is no marker


def test_a_budget_forces_the_special_end_token(harmony_compiler):
    spec = GrammarSpec.any_text(dataclasses.replace(HARMONY_PREFIX, budget=3))
    at_budget = harmony_walk(harmony_compiler, spec, "<|channel|>analysis<|message|>abc")
    assert at_budget.allowed_token_ids() == [HARMONY["<|end|>"]]
    assert at_budget.accept_token(HARMONY["<|end|>"])
    after = harmony_tokens("<|start|>assistant<|channel|>final<|message|>free text")
    assert at_budget.accept_tokens(after) and at_budget.can_end
    call = harmony_walk(harmony_compiler, spec, "<|channel|>analysis<|message|>ab<|end|><|start|>assistant"
                        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}')
    assert call is not None and call.can_end  # a tool call after the analysis, under a budget
