"""What the int8-activation kernels (pagedllm/kernels/csrc/quant_int8_rows.h) do to x, in torch, and
the error that rounding allows: the oracle of tests/kernels/test_quant_int8.py, and the bound of
the few-rows path wherever it takes bf16 activations as int8."""

from __future__ import annotations

import torch

BLOCK = 32  # inputs per activation scale


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels see it: per block of 32, d = max|x| / 127 and q = round(x * (127 /
    max|x|)) (half to even, fp32 product), returned as d * q in float64."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    # A true fp32 division (`127.0 / amax` would be torch's reciprocal, then a product: two roundings).
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse)
    assert codes.abs().max() <= 127
    return (codes.double() * d.double()).reshape(x.shape)


def rounding_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """|x @ W^T - int8_rounded(x) @ W^T| at most: each input off by at most half its block's step
    (d / 2), times |w|, summed: [M, N]."""
    blocks = x.double().reshape(x.shape[0], -1, BLOCK)
    half_step = (blocks.abs().amax(-1, keepdim=True) / 127.0 / 2).expand_as(blocks).reshape(x.shape)
    return half_step @ weight.double().abs().T
