"""A constrained sequence's proposal: cut at the first token its grammar refuses, one mask per
position verified, the matcher left as it was."""

from __future__ import annotations

import pytest
import torch

from pagedllm.spec_decode.grammar import constrain_proposal
from pagedllm.structured.bitmask import allocate_token_bitmask
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.spec import GrammarSpec
from tests.structured.conftest import make_tiny_tokenizer

SPEC = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tiny_compiler():
    compiler = GrammarCompiler(make_tiny_tokenizer())
    yield compiler
    compiler.close()


def _mask_of(matcher) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, matcher.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


def test_valid_prefix_kept_masks_per_position(tiny_compiler):
    matcher = tiny_compiler.matcher(SPEC)
    text = list(b'{"a": 12}')
    before = _mask_of(matcher)
    proposal = text[:4] + [ord("x")] + text[5:]  # the fifth token breaks the grammar
    kept, masks = constrain_proposal(matcher, proposal)
    assert kept == text[:4] and masks.shape[0] == 5
    assert torch.equal(_mask_of(matcher), before) and matcher.num_tokens == 0  # unchanged
    # Each row is the mask of the state after the tokens before it.
    probe = tiny_compiler.matcher(SPEC)
    for i in range(5):
        assert torch.equal(masks[i], _mask_of(probe))
        if i < 4:
            assert probe.accept_token(text[i])


def test_a_whole_valid_proposal_and_a_completed_grammar(tiny_compiler):
    matcher = tiny_compiler.matcher(SPEC)
    text = list(b'{"a": 7}')
    kept, masks = constrain_proposal(matcher, text + [ord(" ")])  # nothing may follow the object
    assert kept == text and masks.shape[0] == len(text) + 1
    assert matcher.num_tokens == 0 and matcher.error is None
    assert matcher.accept_tokens(text)  # still usable from the start
    kept, masks = constrain_proposal(matcher, [])
    assert kept == [] and masks.shape[0] == 1
