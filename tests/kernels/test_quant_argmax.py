"""QuantLinear.argmax (csrc/quant_argmax.cpp: the few-rows kernel and each row's first maximum in
one call) against forward(x).max(-1).indices, on every compiled tier."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.quant_linear import QuantLinear
from pagedllm.model.quant_weight import quantize


def head(bits: int, interleaved: bool, bias: bool) -> QuantLinear:
    """A random quantized head of 96 rows whose rows 7, 40 and 41 are one row: their outputs tie."""
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(96, 128, generator=gen)
    w[40] = w[41] = w[7]
    weight = quantize(w, bits, 32)
    b = torch.randn(96, generator=gen)
    b[40] = b[41] = b[7]
    return QuantLinear([weight.interleave() if interleaved else weight], bias=b if bias else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,interleaved", [(8, False), (8, True), (4, False), (4, True)])
@pytest.mark.parametrize("rows", [1, 5])
def test_argmax_equals_the_maximum_of_forward(tier, dtype, bits, interleaved, rows):
    layer = head(bits, interleaved, bias=bits == 8)
    x = torch.randn(rows, 128).to(dtype)
    x[0] = layer.dequantize(torch.float32)[7].to(dtype)  # row 0's maximum is the tie at 7, 40, 41
    expected = layer(x).max(dim=-1).indices
    got = layer.argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert got[0] == 7  # the first of the tied columns


def test_a_nan_input_gives_forwards_choice(tier):
    layer = head(8, True, bias=False)
    x = torch.randn(2, 128)
    x[1, 3] = float("nan")
    assert torch.equal(layer.argmax(x), layer(x).max(dim=-1).indices)
