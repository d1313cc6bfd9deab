"""The compiled matmuls: over quantized weights (csrc/quant_matmul.cpp for a few rows,
csrc/quant_amx.cpp on AMX tiles for many) and over bf16 weights packed for AMX tiles
(csrc/dense_amx.cpp), from the chosen tier's extension (tiers.py). The model's layers
(model/quant_linear.py, model/packed_linear.py) choose among them when they are built."""

from __future__ import annotations

import torch

from pagedllm.kernels import compiled, tiers


def quant_support(x: torch.Tensor) -> bool:
    """Whether the quantized-weight kernels can take this activation under the chosen tier."""
    return quant_dtype_support(x.dtype, x.device)


def quant_dtype_support(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the quantized-weight kernels work in this dtype on this device."""
    return (device.type == "cpu" and dtype in compiled.KERNEL_DTYPES
            and tiers.current().has("quantized matmul"))


def quant_linear(x: torch.Tensor, weight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = x @ weight^T (+ bias, float32) for a QuantizedWeight; out [M, N] may be a column slice."""
    tiers.current().ops.quant_linear.default(x, *weight.kernel_args, bias, out)


def quant_int8_takes(weight) -> bool:
    """Whether quant_linear under the chosen tier takes bf16 activations against this
    QuantizedWeight as int8 blocks and integer dot products (avx512 with VNNI, avx2), as its layout
    allows (csrc/quant_int8_rows.h: groups of 32k; 4-bit codes whose codebook is consecutive
    integers, Q4_0 / Q4_1 / Q4_K; int8 codes): each block of 32 activations then rounds to steps of
    max|x| / 127. float32 activations always take the exact path."""
    choice = tiers.current()
    return choice.has("quantized matmul") and bool(
        choice.ops.quant_int8_takes(weight.codebook, weight.bits, weight.group_size))


def quant_amx_available() -> bool:
    """Whether quant_linear_amx runs under the chosen tier (amx, and the OS lets us use it)."""
    return tiers.current().quant_amx


def quant_linear_amx(x: torch.Tensor, weight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = x @ weight^T (+ bias) with AMX tiles, for bf16 x of many rows (K a multiple of 32)."""
    tiers.current().ops.quant_linear_amx.default(x, *weight.kernel_args, bias, out)


def quant_dequantize(weight, dtype: torch.dtype) -> torch.Tensor:
    """A QuantizedWeight dequantized to dtype (float32 or bfloat16), [N, K]."""
    return tiers.current().ops.quant_dequantize.default(*weight.kernel_args, dtype)


def quant_linear_argmax(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """(x @ weight^T (+ bias)).max(-1).indices, int64 [M], by quant_linear's kernel in one call."""
    return tiers.current().ops.quant_linear_argmax.default(x, *weight.kernel_args, bias)


def quant_embedding(weight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ids (int64 [n]) of a QuantizedWeight table, plain or row-interleaved, dequantized to
    dtype: [n, K], the same values as quant_dequantize of those rows, in one call."""
    return tiers.current().ops.quant_embedding.default(*weight.kernel_args, ids, dtype)


def dense_amx_available() -> bool:
    """Whether the dense_amx ops run under the chosen tier (amx, the OS lets us use it, and not
    PAGEDLLM_DENSE_AMX=0); the model calls the tier's `dense_amx_mm` itself (packed_linear.py: one call per
    matmul, x [M, K] -> [M, N], gated: [M, N / 2] = silu(gate) * up)."""
    return tiers.current().dense_amx


def dense_amx_pack(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """A bf16 weight [N, K] (K a multiple of 32) in the panel layout the dense_amx ops read; gated:
    a fused [gate | up] projection, its halves side by side in each panel."""
    return tiers.current().ops.dense_amx_pack.default(weight, gated)


def dense_amx_argmax(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    """(x @ weight^T (+ bias)) rounded to bf16, then max(-1).indices: int64 [M], the logits never
    stored (the first of equal maxima; a NaN logit is never chosen)."""
    return tiers.current().ops.dense_amx_argmax.default(x, packed, bias, out_features)
