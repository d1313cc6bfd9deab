"""GGUF's quantized blocks repacked into QuantizedWeight's layouts (quant_weight.py), so the weights
stay quantized in memory and the CPU kernels compute on them.

Each block type is decoded into (code values, a scale per group, a min per group or none),
following gguf's own numpy dequantizer step for step, and computed in the same order, so that
scale * value + min is, in float32, exactly what gguf.quants.dequantize returns. Codes of up to 4
bits become the 4-bit layout (Q2_K and Q3_K too: their 2- and 3-bit codes fit a nibble; MXFP4's
E2M1 codes over their codebook), wider ones the 8-bit layout (Q5_*, Q6_K: one byte per weight
where the file has 5.5-6.5 bits; Q8_0).
Types not listed in REPACKERS are dequantized at load by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from pagedllm.model.quant_weight import LINEAR_CODEBOOK, QuantizedWeight, pack_nibbles

Q = gguf.GGMLQuantizationType
QK_K = 256


@dataclass
class Decoded:
    """A tensor's blocks, decoded: values [n_blocks, block_size] (nibble codes 0..15 for 4-bit
    layouts, int8 values for 8-bit), scales and mins [n_blocks, groups per block]."""

    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None


@dataclass(frozen=True)
class Layout:
    bits: int
    group_size: int
    codebook: tuple[float, ...] | None = None
    # float16 where the block stores its scales (and mins) as fp16 themselves: exact, and no more
    # bytes than the file; float32 for the K-quants, whose scales are products. None: float16
    # where every scale of the tensor is one exactly, else float32 (MXFP4's powers of two: real
    # weights' fit float16, half the bytes; E8M0 reaches 2^127).
    scale_dtype: torch.dtype | None = torch.float16


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte start of each block, as float32 [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _shifts(*bits: int) -> np.ndarray:
    """Bit shifts along axis -2 of a [n, groups, 1, bytes] view: each byte read len(bits) times."""
    return np.array(bits, dtype=np.uint8).reshape(1, 1, len(bits), 1)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [n, 16] in GGUF's Q4_0 order -> codes [n, 32] (low nibbles, then high nibbles)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> Decoded:
    return Decoded(_nibbles(blocks[:, 2:18]), _f16(blocks, 0), None)


def _q4_1(blocks: np.ndarray) -> Decoded:
    return Decoded(_nibbles(blocks[:, 4:20]), _f16(blocks, 0), _f16(blocks, 2))


def _iq4_nl(blocks: np.ndarray) -> Decoded:
    return Decoded(_nibbles(blocks[:, 2:18]), _f16(blocks, 0), None)


def _q8_0(blocks: np.ndarray) -> Decoded:
    return Decoded(np.ascontiguousarray(blocks[:, 2:34]).view(np.int8), _f16(blocks, 0), None)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes 0..31: low 4 bits from qs (Q4_0 order), bit 4 of code i is bit i of qh."""
    high = (np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return _nibbles(qs) | (high.astype(np.uint8) << 4)


def _q5_0(blocks: np.ndarray) -> Decoded:
    values = _five_bits(blocks[:, 2:6], blocks[:, 6:22]).astype(np.int8) - np.int8(16)
    return Decoded(values, _f16(blocks, 0), None)


def _q5_1(blocks: np.ndarray) -> Decoded:
    values = _five_bits(blocks[:, 4:8], blocks[:, 8:24]).astype(np.int8)
    return Decoded(values, _f16(blocks, 0), _f16(blocks, 2))


def _k_scales_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per sub-block of 32, scale d * sc and min -(dmin * m), as gguf computes them."""
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    scales = _f16(blocks, 0) * sc.astype(np.float32)
    mins = -(_f16(blocks, 2) * m.astype(np.float32))
    return scales, mins


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 32 bytes per pair of sub-blocks, the first in the low nibbles."""
    n = qs.shape[0]
    shifted = qs.reshape(n, -1, 1, 32) >> _shifts(0, 4)
    return (shifted & 0x0F).reshape(n, QK_K)


def _q4_k(blocks: np.ndarray) -> Decoded:
    scales, mins = _k_scales_mins(blocks)
    return Decoded(_k_low_nibbles(blocks[:, 16:144]), scales, mins)


def _q5_k(blocks: np.ndarray) -> Decoded:
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks)
    qh = blocks[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(*range(8))
    values = _k_low_nibbles(blocks[:, 48:176]) | ((qh & 1).reshape(n, QK_K) << 4)
    return Decoded(values.astype(np.int8), scales, mins)


def _q6_k(blocks: np.ndarray) -> Decoded:
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, -1, 1, 64) >> _shifts(0, 4)
    qh = blocks[:, 128:192].reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6)
    values = ((ql & 0x0F).reshape(n, QK_K) | ((qh & 0x03).reshape(n, QK_K) << 4)).astype(np.int8)
    values -= np.int8(32)
    scales = _f16(blocks, 208) * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return Decoded(values, scales, None)


def _q2_k(blocks: np.ndarray) -> Decoded:
    n = blocks.shape[0]
    sc = blocks[:, :16]
    scales = _f16(blocks, 80) * (sc & 0x0F).astype(np.float32)
    mins = -(_f16(blocks, 82) * (sc >> 4).astype(np.float32))
    qs = blocks[:, 16:80].reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6)
    return Decoded((qs & 0x03).reshape(n, QK_K), scales, mins)


def _q3_k(blocks: np.ndarray) -> Decoded:
    """Codes -4..3 stored as nibbles 0..7 (the codebook -4..11 maps them back)."""
    n = blocks.shape[0]
    low = blocks[:, 96:104].reshape(n, 1, 1, 8) >> _shifts(0, 4)
    high = blocks[:, 104:108].reshape(n, 1, 1, 4) >> _shifts(0, 2, 4, 6)
    sc = (low.reshape(n, 16) & 0x0F) | ((high.reshape(n, 16) & 0x03) << 4)
    scales = _f16(blocks, 108) * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)
    ql = blocks[:, 32:96].reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6)
    qh = blocks[:, :32].reshape(n, -1, 1, 32) >> _shifts(*range(8))
    # A set high bit means no offset: q = low - 4 * (1 - bit), stored as q + 4.
    codes = (ql & 0x03).reshape(n, QK_K) + ((qh & 0x01).reshape(n, QK_K) << 2)
    return Decoded(codes, scales, None)


def _mxfp4(blocks: np.ndarray) -> Decoded:
    """MXFP4 (gpt-oss's experts): a shared E8M0 exponent byte, then 32 E2M1 codes in Q4_0's nibble
    order. gguf doubles the E2M1 values (the codebook) and halves the power of two (the scale)."""
    return Decoded(_nibbles(blocks[:, 1:17]), gguf.quants.MXFP4.e8m0_to_fp32_half(blocks[:, :1]), None)


_IQ4_NL_VALUES = tuple(float(v) for v in gguf.quants.IQ4_NL.kvalues)
_MXFP4_VALUES = tuple(float(v) for v in gguf.quants.MXFP4.kvalues)

# GGUF type -> (its decoder, the layout it is stored in).
REPACKERS: dict[Q, tuple[Callable[[np.ndarray], Decoded], Layout]] = {
    Q.Q4_0: (_q4_0, Layout(4, 32, tuple(v - 8 for v in LINEAR_CODEBOOK))),
    Q.Q4_1: (_q4_1, Layout(4, 32, LINEAR_CODEBOOK)),
    Q.IQ4_NL: (_iq4_nl, Layout(4, 32, _IQ4_NL_VALUES)),
    Q.MXFP4: (_mxfp4, Layout(4, 32, _MXFP4_VALUES, None)),
    Q.Q8_0: (_q8_0, Layout(8, 32)),
    Q.Q5_0: (_q5_0, Layout(8, 32)),
    Q.Q5_1: (_q5_1, Layout(8, 32)),
    Q.Q2_K: (_q2_k, Layout(4, 16, LINEAR_CODEBOOK, torch.float32)),
    Q.Q3_K: (_q3_k, Layout(4, 16, tuple(v - 4 for v in LINEAR_CODEBOOK), torch.float32)),
    Q.Q4_K: (_q4_k, Layout(4, 32, LINEAR_CODEBOOK, torch.float32)),
    Q.Q5_K: (_q5_k, Layout(8, 32, None, torch.float32)),
    Q.Q6_K: (_q6_k, Layout(8, 16, None, torch.float32)),
}


def _narrowest_exact(scales: np.ndarray) -> torch.dtype:
    """float16 where it holds every scale exactly, else float32."""
    scales = np.asarray(scales, dtype=np.float32)
    with np.errstate(over="ignore"):
        exact = np.array_equal(scales.astype(np.float16).astype(np.float32), scales)
    return torch.float16 if exact else torch.float32


def repack(tensor_type: Q, data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """The raw blocks of a GGUF matrix (data: uint8, row after row) as a QuantizedWeight [N, K]."""
    decode, layout = REPACKERS[tensor_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    n, k = shape
    decoded = decode(np.asarray(data, dtype=np.uint8).reshape(-1, type_size))
    values = decoded.values.reshape(n, k)
    groups = k // layout.group_size
    if layout.bits == 4:
        codes = pack_nibbles(torch.from_numpy(np.ascontiguousarray(values, dtype=np.uint8)))
        codebook = torch.tensor(layout.codebook, dtype=torch.float32)
    else:
        codes, codebook = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int8)), None

    scale_dtype = layout.scale_dtype or _narrowest_exact(decoded.scales)

    def per_group(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(
            np.ascontiguousarray(a, dtype=np.float32).reshape(n, groups)).to(scale_dtype)

    return QuantizedWeight(codes, per_group(decoded.scales), per_group(decoded.mins), layout.bits,
                           layout.group_size, codebook, tensor_type.name)
