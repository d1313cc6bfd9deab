"""Quantized weights: every repackable GGUF type round-trips against gguf's own dequantizer, the
kernels compute the dequantized matmul (up to the order of fp32 sums), and int8 / int4
quantization of float weights stays within its rounding bound."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import matmul, tiers
from pagedllm.model import quant_linear
from pagedllm.model.gguf_repack import REPACKERS, repack
from pagedllm.model.quant_linear import QuantEmbedding, QuantLinear
from pagedllm.model.quant_weight import QuantizedWeight, check_quantizable, quantize
from tests.int8_activations import rounding_error_bound
from tests.kernel_tiers import kernel_tier
from tests.model.quant_blocks import random_blocks, write_tensors

needs_kernel = pytest.mark.skipif(not tiers.current().has("quantized matmul"),
                                  reason=f"CPU kernels unavailable: {tiers.unavailable_reason()}")
TYPES = sorted(REPACKERS, key=lambda t: t.name)
ROWS, COLS = 24, 512  # COLS: two K-quant super-blocks, sixteen 32-blocks


@pytest.fixture(scope="module")
def gguf_tensors(tmp_path_factory):
    """One small tensor of every repackable type, written with gguf's writer and read back."""
    path = tmp_path_factory.mktemp("quant") / "types.gguf"
    write_tensors(path, {t.name: (t, random_blocks(t, ROWS, COLS, seed=i)) for i, t in enumerate(TYPES)})
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def repacked(gguf_tensors, qtype) -> tuple[QuantizedWeight, torch.Tensor]:
    """The tensor of qtype repacked, and gguf's own float32 dequantization of it."""
    tensor = gguf_tensors[qtype.name]
    assert tensor.tensor_type == qtype
    reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, qtype).reshape(ROWS, COLS).copy())
    return repack(qtype, tensor.data, (ROWS, COLS)), reference


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repack_round_trips_exactly(gguf_tensors, qtype):
    weight, reference = repacked(gguf_tensors, qtype)
    assert weight.shape == (ROWS, COLS) and weight.source == qtype.name
    assert torch.equal(weight.dequantize(), reference)
    assert torch.equal(weight.dequantize(torch.bfloat16), reference.to(torch.bfloat16))
    if tiers.current().has("quantized matmul"):
        assert torch.equal(matmul.quant_dequantize(weight, torch.float32), reference)
        assert torch.equal(matmul.quant_dequantize(weight, torch.bfloat16), reference.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repacked_bytes(gguf_tensors, qtype):
    """4-bit layouts hold two codes a byte, 8-bit ones one, plus a scale (and a min) per group;
    the types whose blocks are a fp16 scale (and min) and 4 or 8-bit codes take the file's bytes."""
    weight, _ = repacked(gguf_tensors, qtype)
    groups = ROWS * COLS // weight.group_size
    per_group = weight.scales.element_size() * (1 if weight.mins is None else 2)
    codebook = 64 if weight.bits == 4 else 0
    assert weight.nbytes == ROWS * COLS * weight.bits // 8 + groups * per_group + codebook
    Q = gguf.GGMLQuantizationType
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.IQ4_NL):
        assert weight.nbytes == gguf_tensors[qtype.name].n_bytes + codebook


def test_mxfp4_scales_are_float16_where_that_is_exact(gguf_tensors):
    """MXFP4's scales are powers of two: float16 holds real weights' (one byte a group over the
    file's); a tensor with one out of float16's range keeps float32, and both stay exact."""
    Q = gguf.GGMLQuantizationType
    weight, reference = repacked(gguf_tensors, Q.MXFP4)
    groups = ROWS * COLS // 32
    assert weight.scales.dtype == torch.float16
    assert weight.nbytes == gguf_tensors["MXFP4"].n_bytes + groups + 64
    blocks = np.array(gguf_tensors["MXFP4"].data).reshape(-1, 17)
    blocks[5, 0] = 127 + 100  # 2^99 after gguf's halving: past float16
    wide = repack(Q.MXFP4, blocks, (ROWS, COLS))
    assert wide.scales.dtype == torch.float32
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, Q.MXFP4).reshape(ROWS, COLS).copy())
    assert torch.equal(wide.dequantize(), expected) and expected.abs().max() > 2.0**90


def sum_order_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far two fp32 sums of the same products may differ: K * 2^-23 * sum |x_k w_k|."""
    return weight.shape[1] * 2.0**-23 * (x.abs().double() @ weight.abs().double().T) + 1e-30


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, quant_linear.MAX_KERNEL_ROWS + 1, 70])
def test_quantized_matmul_is_the_dequantized_matmul(tier, gguf_tensors, qtype, rows):
    """Both kernel paths (few rows: in-register dequantization; many: dequantized tiles and a
    GEMM) against the float64 matmul of the dequantized weight, within fp32 summation error."""
    weight, reference = repacked(gguf_tensors, qtype)
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(ROWS)
    out = QuantLinear([weight], bias)(x)
    exact = x.double() @ reference.double().T + bias.double()
    assert out.dtype == torch.float32
    assert ((out.double() - exact).abs() <= sum_order_bound(x, reference) + 1e-6).all()


def bf16_bound(x: torch.Tensor, weight: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """The result rounded once to bf16 (2^-8 relative), the GEMM path's weights rounded to bf16
    (2^-8 of sum |x w|), and the sums' order."""
    magnitude = x.abs().double() @ weight.abs().double().T
    return 2**-8 * exact.abs() + 2**-8 * magnitude + sum_order_bound(x, weight)


def kernel_paths(layer: QuantLinear) -> dict:
    """Every way QuantLinear can multiply here, by name (forward picks one by the row count)."""
    paths = {"few rows": lambda x: layer._kernel(x, matmul.quant_linear),
             "tiles and GEMM": layer._dequantized_tiles}
    if matmul.quant_amx_available():
        paths["AMX"] = lambda x: layer._kernel(x, matmul.quant_linear_amx)
    return paths


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 40, 300])
def test_bfloat16_activations(tier, gguf_tensors, qtype, rows):
    """bf16 activations through every path: few rows (int8 activations and integer dot products
    where the tier and layout take them, within their rounding of x; else 4-bit codes: bf16 dot
    products; 8-bit: the fp32 kernel), AMX tiles (up to and past its 256-row chunks), dequantized
    tiles and a GEMM."""
    weight, reference = repacked(gguf_tensors, qtype)
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(ROWS)
    layer = QuantLinear([weight], bias)
    exact = x.double() @ reference.double().T + bias.double()
    int8 = matmul.quant_int8_takes(weight)
    # x's int8 rounding multiplies scale * code alone (a group's min takes x itself).
    mins = 0 if weight.mins is None else weight.mins.float().repeat_interleave(weight.group_size, dim=1)
    int8_rounding = rounding_error_bound(x, reference - mins) * (1 + 1e-5) if int8 else 0
    few_rows = rows <= (quant_linear.MAX_KERNEL_ROWS_BEFORE_AMX if layer.amx_kernel
                        else quant_linear.MAX_KERNEL_ROWS)
    for name, multiply in {"forward": layer, **kernel_paths(layer)}.items():
        out = multiply(x)
        assert out.dtype == torch.bfloat16
        bound = bf16_bound(x, reference, exact)
        if name == "few rows" or (name == "forward" and few_rows):
            bound = bound + int8_rounding
        assert ((out.double() - exact).abs() <= bound).all(), name


@needs_kernel
@pytest.mark.parametrize("bits,group_size", [(4, 16), (4, 32), (8, 16), (8, 32), (8, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_sizes_that_are_not_a_multiple_of_64(bits, group_size, dtype):
    """96 inputs: the bf16 kernel's last pair of 32-runs has one run."""
    weight = quantize(torch.randn(40, 96) * 0.1, bits, group_size)
    reference = weight.dequantize()
    layer = QuantLinear([weight])
    for rows in (1, 3, 9, 20):
        x = torch.randn(rows, 96).to(dtype)
        exact = x.double() @ reference.double().T
        bound = bf16_bound(x, reference, exact) if dtype == torch.bfloat16 else \
            sum_order_bound(x, reference) + 1e-6
        for name, multiply in kernel_paths(layer).items():
            if name == "AMX" and dtype != torch.bfloat16:
                continue
            int8 = name == "few rows" and dtype == torch.bfloat16 and matmul.quant_int8_takes(weight)
            allowed = bound + rounding_error_bound(x, reference) * (1 + 1e-5) if int8 else bound
            assert ((multiply(x).double() - exact).abs() <= allowed).all(), name


@needs_kernel
def test_fused_parts_of_different_layouts(gguf_tensors):
    """q/k/v stored in different types: one output, each part's columns from its own kernel."""
    Q = gguf.GGMLQuantizationType
    parts = [repacked(gguf_tensors, t) for t in (Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q8_0)]
    layer = QuantLinear([w for w, _ in parts])
    assert len(layer.parts) == 3  # the two Q4_K parts stacked into one
    reference = torch.cat([r for _, r in parts])
    for rows in (1, 40):
        x = torch.randn(rows, COLS)
        out = layer(x)
        assert out.shape == (rows, 4 * ROWS)
        assert ((out.double() - x.double() @ reference.double().T).abs()
                <= sum_order_bound(x, reference) + 1e-6).all()


def test_portable_path_without_kernels(gguf_tensors):
    """Under the portable tier the layer dequantizes tiles and calls F.linear: the reference."""
    weight, reference = repacked(gguf_tensors, gguf.GGMLQuantizationType.Q5_K)
    x = torch.randn(3, COLS)
    with kernel_tier("portable"):
        layer, embedding = QuantLinear([weight]), QuantEmbedding(weight, torch.float32)
    assert not layer.cpu_kernel
    torch.testing.assert_close(layer(x), F.linear(x, reference), atol=1e-6, rtol=1e-6)
    ids = torch.tensor([[3, 0], [23, 3]])
    assert torch.equal(embedding(ids), reference[ids])


@pytest.mark.parametrize("rows", [1, 40])
def test_the_portable_path_never_dequantizes_a_whole_weight(rows, monkeypatch):
    """The portable path's float weights exist one tile of output rows at a time (measured at
    QuantizedWeight.dequantize, where they are made), however large the layer; the tiles' products
    are the whole dequantized weight's."""
    out_features, in_features = 1000, 256
    weight = quantize(torch.randn(out_features, in_features), bits=4, group_size=32)
    parts = [weight.rows(0, 600), quantize(torch.randn(400, in_features), bits=8, group_size=32)]
    monkeypatch.setattr(quant_linear, "PORTABLE_TILE_ELEMENTS", 64 * in_features)
    with kernel_tier("portable"):
        layer = QuantLinear(parts, bias=torch.randn(out_features))
    x = torch.randn(rows, in_features)
    reference = F.linear(x, layer.dequantize(torch.float32), layer.bias)
    made: list[int] = []
    real = QuantizedWeight.dequantize
    monkeypatch.setattr(QuantizedWeight, "dequantize",
                        lambda self, dtype=torch.float32: made.append(self.shape[0]) or real(self, dtype))
    out = layer(x)
    assert made and max(made) == 64 and sum(made) == out_features
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows(gguf_tensors, dtype):
    weight, reference = repacked(gguf_tensors, gguf.GGMLQuantizationType.Q8_0)
    ids = torch.tensor([5, 0, 23, 5])
    rows = QuantEmbedding(weight, dtype)(ids)
    assert rows.dtype == dtype and torch.equal(rows, reference[ids].to(dtype))


@pytest.mark.parametrize("bits,group_size", [(8, 16), (8, 32), (8, 128), (4, 16), (4, 32), (4, 64)])
def test_quantize_within_rounding_bound(bits, group_size):
    """Round to nearest: each weight within half a step of its group's scale, plus float16's
    rounding of the stored min (2^-11 of the group's largest magnitude); a matmul within the sum
    of those over |x|."""
    gen = torch.Generator().manual_seed(bits * group_size)
    w = torch.randn(40, 256, generator=gen) * (0.01 + 0.1 * torch.rand(40, 1, generator=gen))
    w[3, :group_size] = 0  # an all-zero group: scale 0, codes 0
    weight = quantize(w, bits, group_size)
    assert weight.scales.dtype == torch.float16
    largest = w.abs().reshape(40, -1, group_size).amax(-1)
    bound = (weight.scales.float() / 2 + 2**-11 * largest).repeat_interleave(group_size, dim=1)
    error = (weight.dequantize() - w).abs()
    assert (error <= bound * (1 + 1e-5) + 1e-7).all()
    assert torch.equal(weight.dequantize()[3, :group_size], torch.zeros(group_size))
    x = torch.randn(6, 256, generator=gen)
    matmul_error = (F.linear(x, weight.dequantize()) - F.linear(x, w)).abs()
    assert (matmul_error <= x.abs() @ bound.T * 1.001 + 1e-4).all()


def test_quantize_refuses_shapes_the_layouts_cannot_hold():
    assert check_quantizable((8, 96), 4, 32) is None
    assert "multiple of the group size" in check_quantizable((8, 100), 8, 32)
    assert "4-bit" in check_quantizable((8, 144), 4, 48)
    assert "multiple of 16" in check_quantizable((8, 120), 8, 24)
    with pytest.raises(ValueError, match="group size"):
        quantize(torch.randn(4, 100), 8, 32)


def test_select_rows_and_views(gguf_tensors):
    weight, reference = repacked(gguf_tensors, gguf.GGMLQuantizationType.Q4_1)
    order = torch.randperm(ROWS)
    assert torch.equal(weight.select_rows(order).dequantize(), reference[order])
    assert torch.equal(weight.rows(4, 9).dequantize(), reference[4:9])


def test_repack_matches_gguf_on_file_row_layout():
    """repack reads blocks row after row: a matrix whose rows span several blocks."""
    qtype = gguf.GGMLQuantizationType.Q4_0
    data = random_blocks(qtype, 3, 96, seed=7)
    reference = gguf.quants.dequantize(data, qtype).reshape(3, 96)
    assert np.array_equal(repack(qtype, data, (3, 96)).dequantize().numpy(), reference)


def test_quantize_keeps_float32_scales_where_float16_would_lose_them():
    tiny = torch.randn(4, 64) * 1e-5  # scales below float16's normal range
    for bits in (8, 4):
        weight = quantize(tiny, bits, 32)
        assert weight.scales.dtype == torch.float32
        assert (weight.dequantize() - tiny).abs().max() <= weight.scales.max() * 0.5001


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_interleaved_layout_is_the_same_weight(gguf_tensors, qtype):
    """Row-interleaved (16 rows to a vector, for the avx512 int8 kernel): plain() gives back the
    same tensors, and every reader (dequantize, rows, select_rows, columns) the same values."""
    weight, reference = repacked(gguf_tensors, qtype)
    top = weight.rows(0, 16)
    affine = top.bits == 8 or top.codebook.tolist() == [top.codebook[0].item() + i for i in range(16)]
    assert top.interleavable() == (affine and top.group_size % 32 == 0)
    assert not weight.interleavable()  # 24 rows: not whole vectors of 16
    if not top.interleavable():
        with pytest.raises(ValueError, match="cannot be interleaved"):
            top.interleave()
        return
    woven = top.interleave()
    assert woven.interleaved and woven.shape == top.shape and woven.nbytes == top.nbytes
    plain = woven.plain()
    for name in ("codes", "scales", "mins"):
        a, b = getattr(plain, name), getattr(top, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    assert torch.equal(woven.dequantize(), reference[:16])
    picked = torch.tensor([15, 0, 7, 7, 9])
    assert torch.equal(woven.select_rows(picked).dequantize(), reference[picked])
    assert torch.equal(woven.rows(3, 13).dequantize(), reference[3:13])
    assert torch.equal(woven.columns(256, 512).dequantize(), reference[:16, 256:])


def test_interleaving_a_model_keeps_one_copy_of_a_tied_table(gguf_tensors):
    """interleave_for_int8 swaps each weight for its interleaved copy in place, a head tied to the
    embedding table included: the lookups then gather plain rows of the same tensors."""
    weight = repack(gguf.GGMLQuantizationType.Q8_0, gguf_tensors["Q8_0"].data, (ROWS, COLS)).rows(0, 16)
    model = torch.nn.Module()
    model.embed = QuantEmbedding(weight, torch.bfloat16)
    model.head = QuantLinear([weight])
    before = model.embed(torch.tensor([3, 11]))
    x = torch.randn(2, COLS).to(torch.bfloat16)
    with kernel_tier(tiers.current().tier) as choice:
        expected = model.head(x)
        changed = quant_linear.interleave_for_int8(model)
        if not choice.int8_activations:
            assert changed == 0 and model.head.parts[0] is weight
            return
        assert changed == 1 and model.head.parts[0].interleaved
        assert model.embed.weight_q is model.head.parts[0]
        assert torch.equal(model.embed(torch.tensor([3, 11])), before)
        # The same int8 products in another order of fp32 sums, rounded to bf16.
        torch.testing.assert_close(model.head(x), expected, rtol=2**-7, atol=1e-3)
        # and up to max_kernel_rows rows (more than the plain kernel's 16): the int8 kernel still,
        # as the plain one gives them 16 rows at a time.
        rows = torch.randn(model.head.max_kernel_rows, COLS).to(torch.bfloat16)
        plain = QuantLinear([weight])
        by_16 = torch.cat([plain(rows[i:i + 16]) for i in range(0, len(rows), 16)])
        assert model.head.max_kernel_rows > quant_linear.MAX_KERNEL_ROWS
        torch.testing.assert_close(model.head(rows), by_16, rtol=2**-7, atol=1e-3)
