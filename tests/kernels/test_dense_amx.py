"""The bf16 matmul on AMX tiles (csrc/dense_amx.cpp) against F.linear in float32, and the promise
its docstring makes: a row's result does not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kernels import elementwise, matmul
from pagedllm.model.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(not matmul.dense_amx_available(),
                                reason="no AMX-BF16 on this CPU (or the kernels did not build)")


def _random(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _expected(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def _assert_matches(out, expected):
    # fp32 sums in another order, then one rounding to bf16: within a bf16 step of the exact value.
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 64, 100, 300, 529])
@pytest.mark.parametrize("out_features,in_features", [(96, 576), (49, 64), (1000, 96)])
def test_dense_amx_equals_linear(rows, out_features, in_features):
    weight, bias = _random((out_features, in_features), 1), _random((out_features,), 2)
    x = _random((rows, in_features), rows)
    for b in (None, bias):
        layer = PackedLinear(weight, b, 2048)
        assert layer.amx
        _assert_matches(layer(x), _expected(x, weight, b))


def test_dense_amx_reads_strided_rows():
    """x may be a column slice of a wider tensor (rows contiguous, a longer row stride)."""
    weight = _random((64, 128), 3)
    wide = _random((40, 256), 4)
    x = wide[:, 64:192]
    _assert_matches(PackedLinear(weight, None, 2048)(x), _expected(x, weight, None))


def test_input_size_off_the_tile_width_takes_onednn():
    layer = PackedLinear(_random((32, 40), 5), None, 2048)
    assert not layer.amx
    x = _random((7, 40), 6)
    _assert_matches(layer(x), _expected(x, _random((32, 40), 5), None))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 200), row=st.integers(0, 199), seed=st.integers(0, 2**16))
def test_a_rows_result_does_not_depend_on_its_batch(rows, row, seed):
    row %= rows
    weight, bias = _random((80, 96), seed), _random((80,), seed + 1)
    layer = PackedLinear(weight, bias, 2048)
    x = _random((rows, 96), seed + 2)
    assert torch.equal(layer(x)[row], layer(x[row:row + 1])[0])


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_splitting_rows_or_panels_give_the_same_rows(gated, threads):
    """Few rows: threads split the weight's panels; many (8 blocks of 32 per thread or more): they
    split the rows. Either way each row's sums run in one order: a row of a 700-row prefill equals
    the same row multiplied alone, and alone among 40."""
    weight, bias = _random((192, 96), 13), _random((192,), 14)
    x = _random((700, 96), 15)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = PackedLinear(weight, bias, 2048, gated_silu=gated)
        many = layer(x)
        for row in (0, 31, 32, 350, 699):
            assert torch.equal(many[row], layer(x[row:row + 1])[0])
            start = min(row, 660)
            assert torch.equal(many[row], layer(x[start:start + 40])[row - start])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 17, 64, 300, 529])
@pytest.mark.parametrize("intermediate", [1536, 40])
def test_gated_silu_equals_linear_then_silu_and_mul(rows, intermediate):
    """A [gate | up] projection with SiLU-and-mul in its store: the separate ops' result, rounding
    for rounding (gate and up rounded to bf16 first, as the stored gate_up would be)."""
    weight, bias = _random((2 * intermediate, 64), 7), _random((2 * intermediate,), 8)
    x = _random((rows, 64), 9)
    for b in (None, bias):
        gated = PackedLinear(weight, b, 2048, gated_silu=True)
        assert gated.gated_silu and gated.out_features == intermediate
        gate_up = PackedLinear(weight, b, 2048)(x)
        torch.testing.assert_close(gated(x), elementwise.silu_and_mul(gate_up), atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 17, 64, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_equals_max_of_the_stored_logits(rows, threads):
    """The greedy LM head: the index torch's max gives over the stored bf16 logits, ties to the
    first (a vocabulary of repeated rows makes many)."""
    weight = _random((500, 64), 10).repeat(3, 1)[:1400]  # rows i and i + 500 equal: exact ties
    bias = _random((1400,), 11)
    x = _random((rows, 64), 12)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            head = PackedLinear(weight, b, 2048)
            expected = head(x).float().max(dim=-1).indices
            assert torch.equal(head.argmax(x), expected)
            if b is None:
                assert (expected < 500).all()  # the ties were there to break
    finally:
        torch.set_num_threads(before)
