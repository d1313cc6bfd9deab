"""The one table of bounds (pagedllm.sampling_bounds): SamplingParams, the server's bodies and the
core's own check say the same thing, for any value; and whatever SamplingParams accepts, the
core's check on arrival accepts too (validated means runnable)."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagedllm.sampling_bounds import (
    INT64_MAX,
    LIST_BOUNDS,
    MAX_TOP_K,
    NUMBER_BOUNDS,
    check_runnable,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.protocol import CompletionRequest

edge_ints = st.sampled_from([-(2**70), -(2**63) - 1, -(2**63), -(2**31) - 1, -2, -1, 0, 1, 2, 20, 21, 64,
                             65, 2**31 - 1, 2**31, INT64_MAX, 2**63, 2**70])
edge_floats = st.sampled_from([-math.inf, -1.7976931348623157e308, -100.5, -2.0, -1e-300, -0.0, 0.0,
                               5e-324, 1e-9, 1.0, 1.0000001, 2.0, 100.0, 100.5, math.inf, math.nan])
any_number = st.one_of(edge_ints, edge_floats, st.integers(), st.floats())


def _params(name: str, value) -> SamplingParams:
    extra = {"max_tokens": None} if name == "min_tokens" else {}
    return SamplingParams(**{name: value, **extra})


@settings(max_examples=600, deadline=None)
@given(name=st.sampled_from(sorted(NUMBER_BOUNDS)), value=any_number)
def test_sampling_params_take_exactly_what_the_table_admits_and_the_core_runs_it(name, value):
    bound = NUMBER_BOUNDS[name]
    try:
        params = _params(name, value)
    except ValueError as exc:
        assert str(exc).startswith(f"{name} must be"), exc
        assert not bound.admits(value)
        return
    assert bound.admits(value)
    check_runnable(params)  # the core's check on arrival passes whatever was accepted
    if name == "top_k":
        assert params.top_k == (-1 if value in (0, -1) else min(value, MAX_TOP_K))


@settings(max_examples=600, deadline=None)
@given(name=st.sampled_from(sorted(NUMBER_BOUNDS)), value=any_number)
def test_the_server_body_takes_what_the_table_admits(name, value):
    """The pydantic bodies' ranges come from the table: a value is refused by the schema iff the
    table does not admit it (where the body's type takes the value's type at all)."""
    field = "top_logprobs" if name == "logprobs" else name
    body = {"prompt": "hi", field: value}
    if name == "logprobs":  # the completions body declares logprobs itself; check both
        body = {"prompt": "hi", "logprobs": value}
    bound = NUMBER_BOUNDS[name]
    # Past 2**53 a float is no exact integer, and pydantic's choice for an integer field is its
    # own (SamplingParams, built from what it returns, checks the result again).
    assume(not (bound.kind == "int" and isinstance(value, float) and math.isfinite(value)
                and abs(value) > 2**53))
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    type_ok = bound.kind == "float" or integral
    try:
        CompletionRequest.model_validate(body)
        accepted = True
    except ValidationError:
        accepted = False
    if not type_ok or not math.isfinite(value):
        assert not accepted
    else:
        assert accepted == bound.admits(int(value) if bound.kind == "int" else value)


@pytest.mark.parametrize("name", sorted(LIST_BOUNDS))
def test_every_list_is_bounded_in_sampling_params(name):
    limit = LIST_BOUNDS[name]
    value = {"stop": ["x"], "stop_token_ids": [1], "bad_words": ["w"], "allowed_token_ids": [1],
             "logprob_token_ids": [1]}.get(name)
    needs = {"logprobs": 0} if name == "logprob_token_ids" else {}  # they are logprobs' alternatives
    if name == "logit_bias":
        SamplingParams(logit_bias={i: 1.0 for i in range(limit)})
        with pytest.raises(ValueError, match=f"logit_bias must have at most {limit} entries"):
            SamplingParams(logit_bias={i: 1.0 for i in range(limit + 1)})
        return
    SamplingParams(**{name: value * limit}, **needs)
    with pytest.raises(ValueError, match=f"{name} must have at most {limit} entries"):
        SamplingParams(**{name: value * (limit + 1)}, **needs)


@pytest.mark.parametrize("name, value", [("top_k", 2**70), ("seed", 2**64), ("temperature", math.nan),
                                         ("min_p", math.inf), ("n", 10**6), ("max_tokens", 2**40),
                                         ("stop_token_ids", [1] * 65)])
def test_the_core_check_refuses_what_skipped_sampling_params(name, value):
    """A request decoded in the core skips nothing if it was built around SamplingParams' own
    checks (set after construction, as a buggy or hostile client of the core could)."""
    params = SamplingParams()
    setattr(params, name, value)
    with pytest.raises(ValueError, match=name):
        check_runnable(params)


def test_the_core_check_knows_the_vocabulary_when_given_it():
    params = SamplingParams(stop_token_ids=[5], logit_bias={7: 1.0}, allowed_token_ids=[3])
    check_runnable(params, vocab_size=8)
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        check_runnable(params, vocab_size=6)
