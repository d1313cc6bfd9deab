"""The Triton matmul over quantized weights against QuantizedWeight.dequantize + F.linear: every
repackable GGUF type (linear and table codebooks, fp16 and fp32 scales, with and without mins,
groups of 16 and 32), int8 / int4 of other group sizes, decode rows and prefill tiles, shapes that
leave partial tiles, a bias, fused parts writing their own columns. On CUDA where there is one
(`make gpu-check`), natively; elsewhere on Triton's CPU interpreter, with small shapes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed: pip install triton (make test does)")
import gguf  # noqa: E402

from pagedllm.kernels import triton_quant_matmul  # noqa: E402
from pagedllm.model.gguf_repack import REPACKERS, repack  # noqa: E402
from pagedllm.model.quant_linear import QuantLinear  # noqa: E402
from pagedllm.model.quant_weight import QuantizedWeight, quantize  # noqa: E402
from tests.model.quant_blocks import random_blocks  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(
    not ON_GPU and not triton_quant_matmul.interpreting(),
    reason="no CUDA, and triton was imported before TRITON_INTERPRET=1 could be set")

TYPES = sorted(REPACKERS, key=lambda t: t.name)
# The kernel and F.linear sum the same products in other orders: float32 to its rounding; in 16
# bits, the output's own rounding (weights and x are the same 16-bit values in both).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(autouse=True, scope="module")
def _interpreter_while_testing():
    if ON_GPU:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


def gguf_weight(qtype, rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    return on_device(repack(qtype, random_blocks(qtype, rows, cols, seed=seed), (rows, cols)))


def on_device(weight: QuantizedWeight) -> QuantizedWeight:
    return weight.to(DEVICE)


def check(weight: QuantizedWeight, rows: int, dtype=torch.float32, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, weight.shape[1], generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(weight.shape[0], generator=gen).to(dtype).to(DEVICE) if bias else None
    assert triton_quant_matmul.supports(x, [weight])
    got = triton_quant_matmul.linear(x, triton_quant_matmul.prepare([weight]), b)
    expected = F.linear(x.float(), weight.dequantize(dtype).float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, weight.shape[0]) and got.device == x.device
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_every_gguf_type(qtype, rows):
    """Decode rows (1, 5: one 16-row block) and a prefill chunk (40: a partial 64-row tile);
    256 inputs (the K-quants' super-block), 40 outputs (a partial column block)."""
    check(gguf_weight(qtype, 40, 256, seed=rows), rows, seed=rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.IQ4_NL, gguf.GGMLQuantizationType.Q6_K],
                         ids=lambda t: t.name)
def test_half_precision_activations(qtype, dtype):
    check(gguf_weight(qtype, 48, 512, seed=3), 3, dtype=dtype, seed=3)
    check(gguf_weight(qtype, 48, 512, seed=4), 70, dtype=dtype, seed=4)


@pytest.mark.parametrize("bits,group_size", [(8, 16), (8, 64), (8, 128), (8, 512), (4, 16), (4, 64),
                                             (4, 256)])
def test_int8_int4_group_sizes(bits, group_size):
    """Groups narrower and wider than a K step, and a K (576, SmolLM2's hidden size, where 512
    allows) that leaves a partial step."""
    cols = 512 if group_size == 512 else 576 if 576 % group_size == 0 else 512
    weight = on_device(quantize(torch.randn(33, cols) * 0.05, bits, group_size))
    for rows in (2, 17):
        check(weight, rows, bias=True, seed=rows)


def test_non_power_of_two_groups_are_left_to_the_portable_path():
    weight = on_device(quantize(torch.randn(8, 96), 8, 48))
    x = torch.zeros(1, 96, device=DEVICE)
    assert not triton_quant_matmul.supports(x, [weight])


def test_fused_parts_write_their_own_columns():
    """q/k/v in two layouts (as a GGUF may store v in Q6_K and q, k in Q4_K): one output, each
    part its columns, the bias split to match."""
    parts = [gguf_weight(gguf.GGMLQuantizationType.Q4_K, 32, 256, seed=1),
             gguf_weight(gguf.GGMLQuantizationType.Q4_K, 16, 256, seed=2),
             gguf_weight(gguf.GGMLQuantizationType.Q6_K, 16, 256, seed=3)]
    x = torch.randn(6, 256).to(DEVICE)
    bias = torch.randn(64).to(DEVICE)
    got = triton_quant_matmul.linear(x, triton_quant_matmul.prepare(parts), bias)
    expected = F.linear(x, torch.cat([p.dequantize() for p in parts]), bias)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_strided_activations():
    weight = gguf_weight(gguf.GGMLQuantizationType.Q8_0, 16, 128)
    wide = torch.randn(4, 256).to(DEVICE)
    x = wide[:, ::2]
    assert not x.is_contiguous()
    got = triton_quant_matmul.linear(x, triton_quant_matmul.prepare([weight]))
    torch.testing.assert_close(got, F.linear(x, weight.dequantize()), **TOLERANCE[torch.float32])


def test_codebooks_read_once():
    """A linear codebook (0..15, -8..7) becomes an offset; IQ4_NL's table is looked up."""
    offsets = {qtype.name: triton_quant_matmul.GpuWeight.of(gguf_weight(qtype, 8, 256)).book_offset
               for qtype in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0,
                             gguf.GGMLQuantizationType.IQ4_NL)}
    assert offsets == {"Q4_1": 0.0, "Q4_0": -8.0, "IQ4_NL": None}


def test_quant_linear_takes_the_kernel_for_device_tensors(monkeypatch):
    """QuantLinear's hook: on CUDA (here: under the interpreter, on CPU tensors, with the CPU
    kernels' check told no) its forward runs this kernel, whose results equal the portable path's."""
    parts = [gguf_weight(gguf.GGMLQuantizationType.Q4_1, 24, 256, seed=5)]
    layer = QuantLinear(parts, torch.randn(24).to(DEVICE))
    x = torch.randn(3, 256).to(DEVICE)
    calls = []
    run = triton_quant_matmul.linear
    monkeypatch.setattr(triton_quant_matmul, "linear", lambda *a, **k: calls.append(1) or run(*a, **k))
    monkeypatch.setattr("pagedllm.model.quant_linear.on_gpu", lambda rows: True)
    got = layer(x)
    assert calls
    torch.testing.assert_close(got, F.linear(x, layer.dequantize(torch.float32), layer.bias),
                               **TOLERANCE[torch.float32])
