"""Prompt lookup against a brute-force reading of its rule, on tiny alphabets (many repeats)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.spec_decode.ngram import NgramProposer, lookup


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest match n in [min_n, max_n] of the last n tokens ending earlier, its most recent
    occurrence, and what followed, read periodically past the end."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        ends = [e for e in range(n - 1, length - 1) if tokens[e - n + 1:e + 1] == suffix]
        if ends:
            period = length - 1 - ends[-1]
            extended = list(tokens)
            while len(extended) < length + k:
                extended.append(extended[len(extended) - period])
            return extended[length:length + k]
    return []


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int = field(default=0)


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), min_n=st.integers(1, 4),
       extra=st.integers(0, 3), k=st.integers(0, 6))
def test_lookup_matches_reference(tokens, min_n, extra, k):
    max_n = min_n + extra
    got = lookup(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)
    assert got == reference(tokens, min_n, max_n, k)


@settings(max_examples=100, deadline=None)
@given(chunks=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=6),
       k=st.integers(1, 5))
def test_proposer_follows_growing_sequences(chunks, k):
    """The proposer's kept index, grown step by step, gives what a fresh lookup gives."""
    proposer = NgramProposer(2, 4)
    seqs = [Seq("a", []), Seq("b", [])]
    for chunk in chunks:
        seqs[0].token_ids.extend(chunk)
        seqs[1].token_ids.extend(reversed(chunk))
        got = proposer.propose(seqs, [k, k - 1])
        assert got == [reference(seqs[0].token_ids, 2, 4, k), reference(seqs[1].token_ids, 2, 4, k - 1)]
    proposer.forget("a")
    assert "a" not in proposer._indexes


def test_hand_cases():
    # "1 2 3" appeared, then "9 1 2 3" later: the last 3 tokens match twice, the latest wins.
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 1, 2, 3]
    assert lookup(np.array(tokens), 2, 3, 3) == [7, 1, 2]
    # Too short a match: nothing.
    assert lookup(np.array([1, 2, 3, 1]), 2, 3, 3) == []
    # A repeating tail proposes the period, as far as asked.
    assert lookup(np.array([5, 6, 5, 6, 5, 6]), 2, 4, 5) == [5, 6, 5, 6, 5]


def test_bad_lengths_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="2 proposal lengths for 1"):
        NgramProposer(1, 2).propose([Seq("a", [1, 2])], [1, 2])
