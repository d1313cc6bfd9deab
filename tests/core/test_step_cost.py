"""The step cost model (pagedllm.core.step_cost): free tokens = fixed part / part per token,
fitted from steps of different sizes; nothing is guessed before that; a configured value wins."""

from __future__ import annotations

import random

from pagedllm.core.step_cost import StepCost


def test_free_tokens_are_the_fixed_part_over_the_part_per_token():
    cost = StepCost(max_tokens=4096)
    rng = random.Random(0)
    for _ in range(200):  # 6 ms of weight reads, 0.5 ms a token, 5% noise
        tokens = rng.choice([1, 2, 17, 129, 256])
        cost.observe(tokens, (0.006 + 0.0005 * tokens) * rng.uniform(0.95, 1.05))
    assert 10 <= cost.free_tokens() <= 14


def test_nothing_is_estimated_from_steps_of_one_size():
    cost = StepCost(max_tokens=4096)
    for _ in range(50):
        cost.observe(1, 0.007)
    assert cost.free_tokens() is None
    cost.observe(0, 0.001)  # an empty step says nothing either
    assert cost.free_tokens() is None


def test_the_estimate_follows_a_machine_that_changes():
    cost = StepCost(max_tokens=4096)
    for i in range(300):
        cost.observe(1 + 64 * (i % 2), 0.006 + 0.0005 * (1 + 64 * (i % 2)))
    assert cost.free_tokens() == 12
    for i in range(300):  # compute got 4x dearer (a neighbour took the cores' vector units)
        cost.observe(1 + 64 * (i % 2), 0.006 + 0.002 * (1 + 64 * (i % 2)))
    assert cost.free_tokens() == 3


def test_a_fit_without_a_positive_fixed_part_keeps_the_last_estimate_and_stays_in_bounds():
    cost = StepCost(max_tokens=64)
    for i in range(100):
        cost.observe(1 + 100 * (i % 2), 1.0 + 1e-6 * (1 + 100 * (i % 2)))  # nearly free tokens
    assert cost.free_tokens() == 64  # at most the step budget
    for i in range(200):
        cost.observe(1 + 100 * (i % 2), 0.0001 * (1 + 100 * (i % 2)) - 0.00005)  # no fixed part
    assert cost.free_tokens() == 64


def test_a_configured_value_wins():
    cost = StepCost(max_tokens=4096, fixed_free_tokens=5)
    for i in range(50):
        cost.observe(1 + 64 * (i % 2), 0.006 + 0.0005 * (1 + 64 * (i % 2)))
    assert cost.free_tokens() == 5
    assert StepCost(max_tokens=4096, fixed_free_tokens=0).free_tokens() == 0
