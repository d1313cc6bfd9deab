"""Matmuls over quantized weights on the GPU, dequantized inside a Triton kernel: a GGUF's weights
stay quantized in GPU memory (a 4-bit matrix takes about a third of bf16's bytes), and each step
reads the codes, not float weights.

out[M, N] = x[M, K] @ W^T (+ bias), W a quant_weight.QuantizedWeight in one of its two layouts:
- bits=8: int8 codes [N, K]; the code is the value.
- bits=4: uint8 [N, K/2], each run of 32 inputs k0..k0+31 being 16 bytes whose byte j holds code
  k0+j in its low nibble and code k0+16+j in its high one; a code's value is codebook[code].
Then weight = value * scale (+ min), one scale (and min) per group of G inputs.

How the kernel reads them. A program computes a [BLOCK_M, BLOCK_N] tile of out, walking K in
steps of BLOCK_K: it loads the codes of BLOCK_N weight rows once, turns them into values (an
integer offset for the linear codebooks, 0..15 or -8..7; a lookup in the 16-entry table for
IQ4_NL's), multiplies each group by its scale (and adds its min) in float32, rounds to the
activations' dtype (exactly what QuantizedWeight.dequantize(dtype) gives, so results match the
dequantized model's up to the order of the sums) and multiplies on the tensor cores, summing in
float32. The 4-bit runs are never re-interleaved: the low nibbles of a tile's bytes are inputs
k0 + 32r + j and the high ones k0 + 32r + 16 + j, so the kernel loads the matching two halves of
x instead and does two matmuls of half the depth.

Rows: a decode step's few rows (M <= 16) take one 16-row block, so every weight tile is read from
memory once per step (a GEMV's traffic), in narrow column blocks for enough programs; prefill
chunks take 64-row blocks. Group sizes must be powers of two (every GGUF type repacked here has 16
or 32); others are left to the caller's portable path (supports()).

Triton's interpreter (TRITON_INTERPRET=1 before import) runs the same kernel on CPU tensors, which
is how the tests check it on machines without a GPU; as in triton_attention, bfloat16 is widened
to float32 under it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

from pagedllm.model.quant_weight import QuantizedWeight

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRETED = bool(knobs.runtime.interpret)
# Up to this many rows, one 16-row block: the weights are read once (decode steps).
MAX_DECODE_ROWS = 16
# Codebooks that are 16 consecutive integers from an offset: a code's value is code + offset.
_LINEAR_BOOK_OFFSETS = (0.0, -8.0)


def interpreting() -> bool:
    return _INTERPRETED


@dataclass(frozen=True)
class GpuWeight:
    """A QuantizedWeight as the kernel takes it: what was read off the codebook once (a host
    sync at the first call, never inside a step a CUDA graph captures: warm-up calls first)."""

    weight: QuantizedWeight
    book_offset: float | None  # a linear codebook's first value; None: look codes up

    @classmethod
    def of(cls, weight: QuantizedWeight) -> GpuWeight:
        offset = None
        if weight.bits == 4:
            book = weight.codebook.tolist()
            offset = next((o for o in _LINEAR_BOOK_OFFSETS
                           if book == [o + i for i in range(16)]), None)
        return cls(weight, offset)


def supports(x: torch.Tensor, weights: list[QuantizedWeight]) -> bool:
    """Whether the kernel can run x [M, K] against these weights: CUDA tensors (CPU ones under
    the interpreter) on one device, a float dtype, power-of-two group sizes."""
    device_ok = x.device.type == "cuda" or (_INTERPRETED and x.device.type == "cpu")
    return (device_ok and x.dtype in _DTYPES
            and all(w.codes.device == x.device and _is_power_of_two(w.group_size) for w in weights))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def prepare(weights: list[QuantizedWeight]) -> list[GpuWeight]:
    return [GpuWeight.of(w) for w in weights]


def linear(x: torch.Tensor, weights: list[GpuWeight], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (the weights stacked along N)^T + bias: [M, sum of N] in x's dtype, each weight
    writing its own columns. Call only where supports() is true."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_total = sum(w.weight.shape[0] for w in weights)
    out = torch.empty(x.shape[0], n_total, dtype=x.dtype, device=x.device)
    start = 0
    for w in weights:
        end = start + w.weight.shape[0]
        matmul(x, w, None if bias is None else bias[start:end], out[:, start:end])
        start = end
    return out


def matmul(x: torch.Tensor, w: GpuWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] (a column slice of a wider output may be given) = x [M, K] @ W^T (+ bias)."""
    weight = w.weight
    m, k = x.shape
    n = weight.shape[0]
    if k != weight.shape[1]:
        raise ValueError(f"quantized matmul: x has {k} features, the weight takes {weight.shape[1]}")
    if m == 0:
        return
    block_m, block_n, block_k, warps = _launch_shape(m, weight.bits, weight.group_size)
    group = weight.group_size
    mins = weight.mins if weight.mins is not None else weight.scales  # never read without mins
    book = weight.codebook if weight.codebook is not None else weight.scales  # never read for bits=8
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _quant_matmul_kernel[grid](
            x, weight.codes, weight.scales, mins, book, bias if bias is not None else out, out,
            m, n, k,
            x.stride(0), weight.codes.stride(0), weight.scales.stride(0), out.stride(0),
            BITS=weight.bits, GROUP=group, SUB=min(group, block_k),
            HAS_MINS=weight.mins is not None, HAS_BIAS=bias is not None,
            LINEAR_BOOK=w.book_offset is not None, BOOK_OFFSET=w.book_offset or 0.0,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            UPCAST=x.dtype == torch.float32 or (_INTERPRETED and x.dtype == torch.bfloat16),
            num_warps=warps,
        )


def _launch_shape(m: int, bits: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps). Few rows: one 16-row block reading each weight tile
    once, narrow column blocks (more programs to spread a GEMV's bytes over the GPU), deep K
    steps. More rows: square 64 tiles. BLOCK_K is a multiple of 32 (4-bit runs) and of the group
    where the group is smaller."""
    if m <= MAX_DECODE_ROWS:
        return 16, 32, max(128, min(group, 256)), 4
    return 64, 64, max(64, min(group, 128)), 4


@triton.jit
def _group_scaled(values, scales_ptr, mins_ptr, rows, n_valid, first_input, K, stride_s,
                  GROUP: tl.constexpr, RUN: tl.constexpr, RUN_STRIDE: tl.constexpr,
                  DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MINS: tl.constexpr):
    """values [DEPTH, BLOCK_N] (float32) of weight rows `rows`, each group's scale applied (and
    min added). The DEPTH values are DEPTH // RUN runs of RUN inputs that each lie in one group,
    run r starting at input first_input + r * RUN_STRIDE (past K: padding, whose scale is 0)."""
    runs_start = first_input + tl.arange(0, DEPTH // RUN) * RUN_STRIDE
    mask = (runs_start < K)[:, None] & n_valid[None, :]
    where = rows[None, :] * stride_s + (runs_start // GROUP)[:, None]
    scale = tl.load(scales_ptr + where, mask=mask, other=0.0).to(tl.float32)
    grouped = tl.reshape(values, (DEPTH // RUN, RUN, BLOCK_N)) * scale[:, None, :]
    if HAS_MINS:
        low = tl.load(mins_ptr + where, mask=mask, other=0.0).to(tl.float32)
        grouped = grouped + low[:, None, :]
    return tl.reshape(grouped, (DEPTH, BLOCK_N))


@triton.jit
def _code_values(codes, book_ptr, LINEAR_BOOK: tl.constexpr, BOOK_OFFSET: tl.constexpr):
    """4-bit codes (0..15) to their float32 values."""
    if LINEAR_BOOK:
        return codes.to(tl.float32) + BOOK_OFFSET
    return tl.load(book_ptr + codes.to(tl.int32)).to(tl.float32)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, book_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_cn, stride_sn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    SUB: tl.constexpr,  # min(GROUP, BLOCK_K): runs of inputs that share one scale within a tile
    HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    LINEAR_BOOK: tl.constexpr, BOOK_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # matmuls in float32 (IEEE, never TF32)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = rows_m < M
    n_valid = rows_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + rows_m[:, None] * stride_xm
    if BITS == 8:
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_valid = k < K
            x = tl.load(x_rows + k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
            codes = tl.load(codes_ptr + rows_n[None, :] * stride_cn + k[:, None],
                            mask=k_valid[:, None] & n_valid[None, :], other=0)  # [BLOCK_K, BLOCK_N]
            w = _group_scaled(codes.to(tl.float32), scales_ptr, mins_ptr, rows_n, n_valid, k0, K,
                              stride_sn, GROUP, SUB, SUB, BLOCK_K, BLOCK_N, HAS_MINS)
            acc = _dot(x, w.to(x.dtype), acc, UPCAST)
    else:
        # A tile's BLOCK_K / 2 bytes b hold inputs k0 + 32 (b // 16) + b % 16 (low nibbles) and
        # 16 more (high nibbles): two half-depth matmuls against the matching halves of x.
        HALF: tl.constexpr = BLOCK_K // 2
        bs = tl.arange(0, HALF)
        low_inputs = (bs // 16) * 32 + bs % 16
        for k0 in range(0, K, BLOCK_K):
            k_lo = k0 + low_inputs
            k_valid = k_lo < K  # K is a multiple of 32: a run is whole or absent
            byte = tl.load(codes_ptr + rows_n[None, :] * stride_cn + (k0 // 2 + bs)[:, None],
                           mask=k_valid[:, None] & n_valid[None, :], other=0)  # [HALF, BLOCK_N]
            x_mask = m_valid[:, None] & k_valid[None, :]
            x_lo = tl.load(x_rows + k_lo[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=x_mask, other=0.0)
            lo = _code_values(byte & 15, book_ptr, LINEAR_BOOK, BOOK_OFFSET)
            hi = _code_values(byte >> 4, book_ptr, LINEAR_BOOK, BOOK_OFFSET)
            # Each half is HALF // 16 runs of 16 inputs that lie in one group each (groups are 16
            # or a multiple of 32 wide): the low half's run r starts at input k0 + 32 r, the
            # high half's at k0 + 32 r + 16.
            w_lo = _group_scaled(lo, scales_ptr, mins_ptr, rows_n, n_valid, k0, K, stride_sn,
                                 GROUP, 16, 32, HALF, BLOCK_N, HAS_MINS)
            w_hi = _group_scaled(hi, scales_ptr, mins_ptr, rows_n, n_valid, k0 + 16, K, stride_sn,
                                 GROUP, 16, 32, HALF, BLOCK_N, HAS_MINS)
            acc = _dot(x_lo, w_lo.to(x_lo.dtype), acc, UPCAST)
            acc = _dot(x_hi, w_hi.to(x_hi.dtype), acc, UPCAST)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rows_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows_m[:, None] * stride_om + rows_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_valid[:, None] & n_valid[None, :])

