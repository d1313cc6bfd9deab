"""Matchers walked through random valid token sequences of SmolLM2's vocabulary stay consistent
with their forks, replays and rollbacks; masks allow exactly the tokens the library accepts; EOS
is allowed only where the grammar may end."""

import json
import random

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.structured.bitmask import allocate_token_bitmask, apply_token_bitmask_
from pagedllm.structured.matcher import BitmaskFiller
from pagedllm.structured.spec import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
SPEC = GrammarSpec.json_schema(SCHEMA)
WALK = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _walk(data, matcher, steps, label):
    """Accept `steps` tokens drawn from each state's mask; returns (tokens, masks) with
    masks[i] the allowed ids after i of the tokens."""
    tokens, masks = [], [matcher.allowed_token_ids()]
    for _ in range(steps):
        if matcher.is_terminated:
            break
        token = data.draw(st.sampled_from(masks[-1]), label=label)
        assert matcher.accept_token(token), matcher.error
        tokens.append(token)
        masks.append(matcher.allowed_token_ids())
    return tokens, masks


@WALK
@given(data=st.data())
def test_forks_replays_and_rollbacks_agree(smol_compiler, smol_tokenizer, data):
    eos = set(smol_tokenizer.eos_token_ids)
    parent = smol_compiler.matcher(SPEC)
    prefix, prefix_masks = _walk(data, parent, data.draw(st.integers(0, 12)), "prefix")
    child = parent.fork()
    rest, rest_masks = _walk(data, parent, data.draw(st.integers(0, 12)), "parent")
    tokens, masks = prefix + rest, prefix_masks + rest_masks[1:]
    child_tokens, child_masks = _walk(data, child, data.draw(st.integers(0, 12)), "child")

    for walked, history, expected in ((parent, tokens, masks), (child, prefix + child_tokens, child_masks)):
        # The state is what its tokens make it, whatever the other one did.
        assert walked.allowed_token_ids() == expected[-1]
        assert walked.num_tokens == len(history)
        fresh = smol_compiler.matcher(SPEC)
        assert fresh.replay(history)
        assert fresh.allowed_token_ids() == expected[-1]
        assert fresh.can_end == walked.can_end and fresh.is_terminated == walked.is_terminated
        # EOS is in the mask exactly where the grammar may end.
        assert bool(eos & set(expected[-1])) == walked.can_end

    back = data.draw(st.integers(0, len(tokens)), label="rollback")
    parent.rollback(back)
    assert parent.allowed_token_ids() == masks[len(tokens) - back]
    assert parent.accept_tokens(tokens[len(tokens) - back:])
    assert parent.allowed_token_ids() == masks[-1]


@WALK
@given(seed=st.integers(0, 2**32))
def test_a_walk_that_ends_is_valid_json_for_the_schema(smol_compiler, smol_tokenizer, seed):
    """Uniformly random tokens, EOS as soon as it is allowed: every walk ends, and its text
    validates."""
    rng = random.Random(seed)
    eos = smol_tokenizer.eos_token_ids
    matcher = smol_compiler.matcher(SPEC)
    tokens = []
    for _ in range(300):
        allowed = matcher.allowed_token_ids()
        if matcher.can_end:
            assert matcher.accept_token(eos[0]) and matcher.is_terminated
            break
        assert not set(eos) & set(allowed)
        token = rng.choice(allowed)
        assert matcher.accept_token(token), matcher.error
        tokens.append(token)
    assert matcher.is_terminated
    jsonschema.validate(json.loads(smol_tokenizer.decode(tokens)), SCHEMA)


def test_masks_allow_exactly_what_the_library_accepts(smol_compiler, smol_tokenizer):
    texts = ['{"name": "', '{"name": "ab', '{"name": "x", "n": 1', '{"name": "x", "n": 12, "tags": [',
             '{"name": "x", "n": -5, "ok": ', '{"name": "', '{"name": "x", "n": 3}', "", '{"name": "q"']
    matchers = []
    for text in texts:
        matcher = smol_compiler.matcher(SPEC)
        assert matcher.accept_tokens(smol_tokenizer.encode(text, add_special_tokens=False))
        matchers.append(matcher)
    rows = list(range(len(matchers)))[::-1]  # rows need not follow the matchers' order
    assert len(rows) >= BitmaskFiller.MIN_PARALLEL
    for filler in (BitmaskFiller(), BitmaskFiller(num_threads=2)):
        bitmask = allocate_token_bitmask(len(matchers), smol_compiler.vocab_size)
        filler.fill(bitmask, list(zip(matchers, rows)))
        logits = torch.randn(len(matchers), smol_compiler.vocab_size)
        apply_token_bitmask_(logits, bitmask, smol_compiler.vocab_size)
        for matcher, row in zip(matchers, rows):
            allowed = matcher.allowed_token_ids()
            assert logits[row].isfinite().nonzero().flatten().tolist() == allowed
    generator = torch.Generator().manual_seed(0)
    for matcher in matchers:
        allowed = set(matcher.allowed_token_ids())
        picks = torch.randint(0, smol_compiler.vocab_size, (40,), generator=generator).tolist()
        picks += sorted(allowed)[:: max(1, len(allowed) // 40)]
        for token in picks:
            assert matcher.fork().accept_token(token) == (token in allowed), token


def test_eos_only_where_the_grammar_may_end(tiny_compiler, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_ids[0]
    matcher = tiny_compiler.matcher(GrammarSpec.regex("ab(cd)?"))
    assert not matcher.can_end and eos not in matcher.allowed_token_ids()
    assert not matcher.fork().accept_token(eos)
    assert matcher.accept_tokens(tiny_tokenizer.encode("ab", add_special_tokens=False))
    assert matcher.can_end and not matcher.is_terminated  # may end, or go on with "cd"
    assert matcher.allowed_token_ids() == [ord("c"), eos]
    assert matcher.accept_tokens([ord("c"), ord("d")])
    assert matcher.is_terminated and matcher.allowed_token_ids() == [eos]
    assert matcher.accept_token(eos) and matcher.is_terminated and matcher.error is None


def test_a_refused_token_leaves_the_matcher_in_error(tiny_compiler, tiny_tokenizer):
    matcher = tiny_compiler.matcher(GrammarSpec.regex("a+"))
    assert not matcher.accept_token(ord("b"))
    assert matcher.error and matcher.is_terminated
    assert not matcher.accept_token(ord("a"))  # in error for good
    assert matcher.allowed_token_ids() == tiny_tokenizer.eos_token_ids  # only ending is left
    matcher.reset()
    assert matcher.error is None and matcher.accept_token(ord("a"))


def test_out_of_range_tokens_and_bad_rollbacks(tiny_compiler):
    matcher = tiny_compiler.matcher(GrammarSpec.regex("a+"))
    outside = matcher.fork()
    assert not outside.accept_token(tiny_compiler.vocab_size)
    assert "token id 258 out of range" in outside.error and outside.is_terminated
    assert matcher.accept_tokens([ord("a"), ord("a")])
    with pytest.raises(ValueError, match="cannot roll back 3 tokens; 2 accepted"):
        matcher.rollback(3)
    matcher.rollback(2)
    assert matcher.num_tokens == 0 and not matcher.can_end
