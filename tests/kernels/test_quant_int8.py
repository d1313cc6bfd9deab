"""The few-rows quantized matmul over int8 activations (csrc/quant_int8_rows.h: avx512 with VNNI,
avx2), which takes bf16 activations against the layouts that allow it: against the dequantized
matmul of x rounded as the kernel rounds it (tests/int8_activations.py), within fp32 sums and the
output's bf16 rounding; and against the float matmul, within that rounding of x (half a step of
max|x| / 127 per input, times |w|)."""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedllm.kernels import matmul, tiers
from pagedllm.model.gguf_repack import repack
from pagedllm.model.quant_weight import QuantizedWeight, quantize
from pagedllm.utils import cpu_flags
from tests.int8_activations import int8_rounded, rounding_error_bound
from tests.model.quant_blocks import random_blocks, write_tensors

Q = gguf.GGMLQuantizationType
INT8_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K]  # groups of 32, affine codes
OTHER_TYPES = [Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q6_K]  # a codebook table, or groups of 16
ROWS, COLS = 40, 512
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 16]


@pytest.fixture(scope="module")
def gguf_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("int8") / "types.gguf"
    types = INT8_TYPES + OTHER_TYPES
    write_tensors(path, {t.name: (t, random_blocks(t, ROWS, COLS, seed=i)) for i, t in enumerate(types)})
    return {t.name: repack(t.tensor_type, t.data, (ROWS, COLS)) for t in gguf.GGUFReader(path).tensors}


def tier_has_int8(tier: str) -> bool:
    return tier == "avx2" or (tier == "avx512" and "avx512_vnni" in cpu_flags())


def kernel(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    matmul.quant_linear(x, weight, bias, out)
    return out


def split(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's weights as scale * code and the mins (zeros where there are none), float64 [N, K]."""
    values = weight.dequantize().double()
    mins = torch.zeros_like(values) if weight.mins is None else \
        weight.mins.double().repeat_interleave(weight.group_size, dim=1)
    return values - mins, mins


def emulated(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor) -> torch.Tensor:
    """float64: x rounded as the kernel rounds it times gguf's weights, the mins' term on x itself."""
    scaled, mins = split(weight)
    return int8_rounded(x) @ scaled.T + x.double() @ mins.T + bias.double()


def fp32_sums_bound(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """How far fp32 sums of the two terms (codes, mins: each may be larger than their sum) may be
    from the exact ones: K * 2^-22 of their magnitudes."""
    scaled, mins = split(weight)
    magnitude = x.double().abs() @ (scaled.abs() + mins.abs()).T
    return weight.shape[1] * 2.0**-22 * magnitude + 1e-30


def check(tier: str, weight: QuantizedWeight, x: torch.Tensor) -> None:
    bias = torch.randn(weight.shape[0])
    out = kernel(x, weight, bias).double()
    weight = weight.plain()  # the references read the plain layout
    # Exactly the integer arithmetic: the emulation, to the output's bf16 rounding and fp32 sums.
    expected = emulated(x, weight, bias)
    values = weight.dequantize()
    near = 2**-8 * expected.abs() + fp32_sums_bound(x, weight)
    assert ((out - expected).abs() <= near).all(), (out - expected).abs().max()
    # The float matmul, within the rounding of x that the int8 blocks allow: x's error multiplies
    # scale * code alone (the mins' term takes x itself), which is larger than |w| where a min
    # offsets it.
    exact = x.double() @ values.double().T + bias.double()
    allowed = rounding_error_bound(x, split(weight)[0]) * (1 + 1e-5) + near
    assert ((out - exact).abs() <= allowed).all()


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 rows with an outlier channel (as LLM activations have), zeros in one block."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 30
    x[:, 32:64] = 0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_gguf_types(tier, gguf_weights, qtype, rows):
    weight = gguf_weights[qtype.name]
    assert matmul.quant_int8_takes(weight) == tier_has_int8(tier)
    if not tier_has_int8(tier):
        pytest.skip(f"the {tier} tier keeps bf16 activations")
    check(tier, weight, activations(rows, COLS, rows))


@pytest.mark.parametrize("bits,group_size,cols", [(4, 32, 96), (8, 32, 96), (4, 64, 192), (8, 128, 384),
                                                  (4, 32, 160), (8, 64, 64)])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_group_sizes_and_odd_blocks(tier, bits, group_size, cols, rows):
    """Groups of 32 and of multiples of 64; K an odd number of 32-blocks (the AVX-512 kernel's last
    pair of blocks has one)."""
    if not tier_has_int8(tier):
        pytest.skip(f"the {tier} tier keeps bf16 activations")
    weight = quantize(torch.randn(24, cols) * 0.1, bits, group_size)
    assert matmul.quant_int8_takes(weight)
    check(tier, weight, activations(rows, cols, cols + rows))


@pytest.mark.parametrize("qtype", OTHER_TYPES, ids=lambda t: t.name)
def test_layouts_without_int8_keep_bf16(tier, gguf_weights, qtype):
    """A codebook table (IQ4_NL) or groups of 16: the bf16 / fp32 kernel, no int8 rounding."""
    weight = gguf_weights[qtype.name]
    assert not matmul.quant_int8_takes(weight)


def interleaved(tier: str, weight: QuantizedWeight) -> QuantizedWeight:
    """weight in the row-interleaved layout (32 of its rows), where the tier's kernel reads it."""
    if not tiers.current().int8_activations:
        with pytest.raises(RuntimeError, match="row-interleaved weights need"):
            kernel(activations(1, weight.shape[1], 0), weight.rows(0, 32).interleave(), torch.zeros(32))
        pytest.skip(f"the {tier} tier reads the plain layout alone")
    return weight.rows(0, 32).interleave()


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_interleaved_gguf_types(tier, gguf_weights, qtype, rows):
    """The row-interleaved kernel (16 weight rows to a vector), float32 and bf16 activations alike
    rounded to int8 blocks, to the same bounds."""
    weight = interleaved(tier, gguf_weights[qtype.name])
    for dtype in (torch.bfloat16, torch.float32):
        check(tier, weight, activations(rows, COLS, rows).to(dtype))


@pytest.mark.parametrize("bits,group_size,cols", [(4, 32, 96), (8, 32, 96), (4, 64, 192), (8, 128, 384),
                                                  (4, 32, 160), (8, 64, 64)])
@pytest.mark.parametrize("rows", [1, 6])
def test_interleaved_group_sizes(tier, bits, group_size, cols, rows):
    weight = interleaved(tier, quantize(torch.randn(48, cols) * 0.1, bits, group_size))
    check(tier, weight, activations(rows, cols, cols + rows))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7])
def test_interleaved_groups_alone_or_in_pairs_agree(tier, bits, rows):
    """Groups of 16 weight rows taken two at a time (AVX-512: each broadcast of x feeds both) give
    bit for bit what each group gives alone: 48 rows (a pair, then one) against 16 at a time."""
    plain = quantize(torch.randn(48, COLS) * 0.1, bits, 32)
    interleaved(tier, plain)  # skips where the tier reads the plain layout alone
    x = activations(rows, COLS, 7 * rows)
    bias = torch.randn(48)
    alone = [kernel(x, plain.rows(lo, lo + 16).interleave(), bias[lo:lo + 16]) for lo in (0, 16, 32)]
    assert torch.equal(kernel(x, plain.interleave(), bias), torch.cat(alone, dim=1))


@pytest.mark.parametrize("bits", [8, 4])
def test_interleaved_rows_do_not_depend_on_the_others(tier, bits):
    """Each row of x gives bit for bit the same output alone as in a pass of 4, 5 or 6 rows (what
    batch-invariant mode and speculation's verification rows rely on)."""
    plain = quantize(torch.randn(32, COLS) * 0.1, bits, 32)
    interleaved(tier, plain)
    weight, bias = plain.interleave(), torch.randn(32)
    x = activations(11, COLS, 3)
    alone = torch.cat([kernel(x[i:i + 1], weight, bias) for i in range(11)])
    for rows in (4, 5, 6, 11):
        assert torch.equal(kernel(x[:rows], weight, bias), alone[:rows])


@pytest.mark.parametrize("bits", [8, 4])
def test_interleaved_prefill_rows_in_blocks(tier, bits):
    """A prefill chunk's rows (700 of 512 inputs: three of rows_per_l2_block's blocks of 300, the
    last one short) give bit for bit what each row gives alone, and the emulated int8 matmul."""
    plain = quantize(torch.randn(32, COLS) * 0.1, bits, 32)
    interleaved(tier, plain)
    weight, bias = plain.interleave(), torch.randn(32)
    x = activations(700, COLS, 11)
    many = kernel(x, weight, bias)
    rows = [0, 1, 298, 299, 300, 301, 597, 599, 600, 601, 695, 699]
    assert torch.equal(many[rows], torch.cat([kernel(x[i:i + 1], weight, bias) for i in rows]))
    check(tier, weight, x[::37].contiguous())


def test_float32_activations_stay_exact(tier, gguf_weights):
    weight = gguf_weights["Q4_1"]
    x = activations(3, COLS, 0).float()
    out = kernel(x, weight, torch.zeros(ROWS)).double()
    exact = x.double() @ weight.dequantize().double().T
    assert ((out - exact).abs() <= fp32_sums_bound(x, weight) + 1e-6).all()
