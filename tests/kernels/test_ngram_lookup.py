"""The compiled n-gram lookup (csrc/decode_burst.cpp's, which proposes inside a decode burst) gives
spec_decode/ngram.py's proposal for any sequence, on tiny alphabets (many repeats), on every tier."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedllm.kernels import tiers
from pagedllm.spec_decode.ngram import lookup


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), min_n=st.integers(1, 4),
       extra=st.integers(0, 3), k=st.integers(0, 9))
@example(tokens=[1, 2, 1, 2, 1], min_n=2, extra=0, k=5)  # the match runs into the end: periodic
@example(tokens=[1, 2, 3, 1, 2, 3, 1, 2], min_n=2, extra=3, k=4)  # longest of several matches
def test_the_compiled_lookup_proposes_what_the_python_one_does(tier, tokens, min_n, extra, k):
    expected = lookup(np.array(tokens, dtype=np.int64), min_n, min_n + extra, k)
    got = tiers.current().ops.ngram_lookup(torch.tensor(tokens, dtype=torch.long), min_n, min_n + extra, k)
    assert got == expected


def test_bad_lengths_are_refused(tier):
    with pytest.raises(RuntimeError, match="min_n <= max_n"):
        tiers.current().ops.ngram_lookup(torch.tensor([1, 2, 1], dtype=torch.long), 3, 2, 4)
