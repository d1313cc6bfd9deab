"""Speculation's counters and the adaptive choice of k."""

from __future__ import annotations

import pytest

from pagedllm.spec_decode.metrics import (
    METRIC_NAMES,
    AcceptanceRate,
    SpecDecodeStats,
    choose_k,
    expected_tokens,
)


def test_stats_count_as_vllm_does():
    stats = SpecDecodeStats()
    stats.observe(4, 2)
    stats.observe(3, 3)
    stats.observe(0, 0)  # proposed nothing: no draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 7, 5)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1, 0]
    assert stats.acceptance_rate == pytest.approx(5 / 7)
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 2)
    assert stats.to_dict()["num_drafts"] == 2
    assert METRIC_NAMES["num_drafts"] == "pagedllm:spec_decode_num_drafts"
    with pytest.raises(ValueError, match="3 accepted of 2"):
        stats.observe(2, 3)


def test_acceptance_rate_estimates_the_per_token_chance():
    rate = AcceptanceRate(prior=0.5, decay=0.999)
    assert rate.value == 0.5
    for _ in range(2000):  # each step: 3 of 4 kept, then a rejection: a = 3 / 4
        rate.observe(4, 3)
    assert rate.value == pytest.approx(0.75, abs=0.01)
    low = AcceptanceRate()
    for _ in range(50):
        low.observe(4, 0)
    assert low.value < 0.1  # the prior (1 of 2) against ~10 recent rejections
    for _ in range(100):  # no proposals for a while: back toward the prior
        low.idle()
    assert low.value > 0.4


def test_choose_k_follows_its_rule():
    # One stream, proposals mostly right: propose as many as allowed.
    assert choose_k(0.9, 1, 8) == 8
    # Proposals never right: never propose.
    assert choose_k(0.0, 1, 8) == 0
    # A large batch is compute-bound: no k pays off even if every proposal is right.
    assert choose_k(1.0, 64, 8) == 0
    # In between, fewer as the batch grows.
    ks = [choose_k(0.8, batch, 8) for batch in (1, 4, 16, 32, 64)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[2] > 0 and ks[-1] == 0
    # The choice is the argmax of the modelled tokens per unit of time.
    for batch in (1, 8, 24):
        k = choose_k(0.7, batch, 6)
        rates = [expected_tokens(0.7, j) / (1 + 0.02 * batch * j) for j in range(7)]
        assert rates[k] == max(rates)


def test_choose_k_refuses_nonsense():
    with pytest.raises(ValueError, match="acceptance"):
        choose_k(1.5, 1, 4)
    with pytest.raises(ValueError, match="batch_size"):
        choose_k(0.5, 0, 4)
