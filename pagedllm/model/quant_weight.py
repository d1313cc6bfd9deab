"""A weight matrix kept quantized: integer codes in groups along the input features, each group
with a scale (and optionally a min), in the two layouts the CPU kernels read
(pagedllm/kernels/csrc/quant_matmul.cpp). GGUF's block types are repacked into them
(gguf_repack.py); float weights are quantized into them here (`quantize`, for `--quantization
int8 / int4` on Hugging Face folders).

Layouts, for a matrix [out_features N, in_features K] and group size G:
- bits=4: `codes` uint8 [N, K/2]. Each run of 32 inputs k0..k0+31 is 16 bytes: byte j holds code
  k0+j in its low nibble and k0+16+j in its high one (GGUF's Q4_0 / Q4_1 order). A code indexes
  `codebook` (16 float32 values: 0..15, -8..7, IQ4_NL's table, MXFP4's E2M1 values doubled). G is
  16 or a multiple of 32.
- bits=8: `codes` int8 [N, K]; the code is the value. G is a multiple of 16.
- `scales`, `mins`: [N, K/G], float16 where that holds them exactly (the GGUF types whose blocks
  store fp16 scales: a decode step then reads no more bytes than the file holds; and int8 / int4
  here where float16 keeps their precision) or float32 (the K-quants' products of a super-block
  scale and a sub-block one).
  Weight = scale * value + min (min absent: scale * value).
- Row-interleaved (`interleave()`, for the int8 kernels of bf16 models at the avx512 and avx2
  tiers: one int32 lane of a vector per weight row, csrc/quant_int8_rows.h): `codes` [N/16, K/32,
  256 (4-bit) or 512 (int8)], `scales`, `mins` [N/16, groups, 16]. The same bytes reordered;
  `plain()` undoes it, and every method here other than kernel_args, to() and nbytes reads the
  plain layout (row slices and embedding lookups take only the rows they need).

For every GGUF type repacked here, scale * value is exact in float32 (an fp16 scale times a small
integer; MXFP4: a power of two times one), so dequantizing gives bit for bit the float32 values
gguf's own dequantizer gives.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

LINEAR_CODEBOOK = tuple(float(i) for i in range(16))
INTERLEAVED_ROWS = 16  # weight rows per vector in the row-interleaved layout


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    codebook: torch.Tensor | None  # bits=4 only
    source: str  # what it came from, for logs: a GGUF type name ("Q4_1") or "int4" / "int8"

    def __post_init__(self) -> None:
        n, k = self.shape
        why = check_quantizable((n, k), self.bits, self.group_size)
        if why:
            raise ValueError(f"quantized weight [{n}, {k}]: {why}")
        expected = ((n // INTERLEAVED_ROWS, k // self.group_size, INTERLEAVED_ROWS) if self.interleaved
                    else (n, k // self.group_size))
        if self.scales.shape != expected or (
                self.mins is not None and self.mins.shape != self.scales.shape):
            raise ValueError(f"quantized weight: scales {tuple(self.scales.shape)} do not match "
                             f"{list(expected)}")

    @property
    def kernel_args(self) -> tuple:
        """The arguments the CPU kernels take for this weight, in their order."""
        return self.codes, self.scales, self.mins, self.codebook, self.bits, self.group_size

    @property
    def shape(self) -> tuple[int, int]:
        if self.interleaved:
            return self.codes.shape[0] * INTERLEAVED_ROWS, self.codes.shape[1] * 32
        rows, width = self.codes.shape
        return rows, width * 2 if self.bits == 4 else width

    @property
    def interleaved(self) -> bool:
        """Whether the codes are in the row-interleaved layout (the module docstring)."""
        return self.codes.dim() == 3

    def interleavable(self) -> bool:
        """Whether interleave() takes this weight: rows a multiple of 16, groups of 32k, and codes
        the int8 kernel reads (int8, or 4-bit codes whose codebook is consecutive integers)."""
        n, _ = self.shape
        if self.interleaved or n % INTERLEAVED_ROWS or self.group_size % 32:
            return False
        if self.bits == 8:
            return True
        book = self.codebook.tolist()
        return book[0] == int(book[0]) and book == [book[0] + i for i in range(16)]

    def interleave(self) -> QuantizedWeight:
        """This weight in the row-interleaved layout (a copy; interleavable() must hold)."""
        if not self.interleavable():
            raise ValueError(f"quantized weight {self.shape} ({self.source}) cannot be interleaved")
        n, k = self.shape
        groups, chunks = n // INTERLEAVED_ROWS, 4 if self.bits == 4 else 8
        codes = (self.codes.view(groups, INTERLEAVED_ROWS, k // 32, chunks, 4).permute(0, 2, 3, 1, 4)
                 .reshape(groups, k // 32, chunks * 4 * INTERLEAVED_ROWS).contiguous())

        def by_group(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.view(groups, INTERLEAVED_ROWS, -1).transpose(1, 2).contiguous()
        return dataclasses.replace(self, codes=codes, scales=by_group(self.scales), mins=by_group(self.mins))

    def plain(self) -> QuantizedWeight:
        """This weight in the plain layout (itself where it is plain already)."""
        if not self.interleaved:
            return self
        return self._gather(slice(None), slice(None))

    def _gather(self, groups, lanes) -> QuantizedWeight:
        """Plain rows of an interleaved weight: rows groups * 16 + lanes (two index tensors of
        equal shape, or two full slices: every row)."""
        num_groups, blocks, width = self.codes.shape
        chunks = width // (4 * INTERLEAVED_ROWS)
        grid = self.codes.view(num_groups, blocks, chunks, INTERLEAVED_ROWS, 4)
        if isinstance(groups, slice):  # every row, in order
            codes = grid.permute(0, 3, 1, 2, 4).reshape(num_groups * INTERLEAVED_ROWS, blocks * chunks * 4)

            def rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.transpose(1, 2).reshape(num_groups * INTERLEAVED_ROWS, -1)
        else:
            codes = grid[groups, :, :, lanes, :].reshape(len(groups), blocks * chunks * 4)

            def rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t[groups, :, lanes]
        return dataclasses.replace(self, codes=codes.contiguous(), scales=rows_of(self.scales).contiguous(),
                                   mins=None if self.mins is None else rows_of(self.mins).contiguous())

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.mins, self.codebook)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def layout(self) -> tuple:
        """What must agree for two weights to be stacked into one (same kernel, same codebook)."""
        book = None if self.codebook is None else tuple(self.codebook.tolist())
        return self.bits, self.group_size, self.mins is not None, self.scales.dtype, book, self.interleaved

    def values(self) -> torch.Tensor:
        """The code values as float32 [N, K] (before scale and min)."""
        if self.interleaved:
            return self.plain().values()
        n, k = self.shape
        if self.bits == 8:
            return self.codes.float()
        runs = self.codes.view(n, k // 32, 16)
        nibbles = torch.cat([runs & 15, runs >> 4], dim=-1).reshape(n, k)
        return self.codebook[nibbles.long()]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K]: the portable torch path, and the reference for the kernels."""
        if self.interleaved:
            return self.plain().dequantize(dtype)
        n, k = self.shape
        values = self.values().view(n, k // self.group_size, self.group_size)
        grouped = values * self.scales.float()[..., None]
        if self.mins is not None:
            grouped = grouped + self.mins.float()[..., None]
        return grouped.view(n, k).to(dtype)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of rows index (a permutation, or the rows an embedding looks up), plain."""
        if self.interleaved:
            return self._gather(index // INTERLEAVED_ROWS, index % INTERLEAVED_ROWS)
        return dataclasses.replace(
            self, codes=self.codes.index_select(0, index), scales=self.scales.index_select(0, index),
            mins=None if self.mins is None else self.mins.index_select(0, index))

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """Input features start..end, a copy (a row-parallel shard); ValueError unless both ends
        fall on group boundaries (and, for 4-bit codes, on the 32-input runs they are packed in)."""
        if self.interleaved:
            return self.plain().columns(start, end)
        why = self.column_split_error(start) or self.column_split_error(end)
        if why:
            raise ValueError(f"quantized weight [{self.shape[0]}, {self.shape[1]}] ({self.source}): "
                             f"cannot take inputs {start}..{end}: {why}")
        per_code = 2 if self.bits == 4 else 1
        g0, g1 = start // self.group_size, end // self.group_size
        return dataclasses.replace(
            self, codes=self.codes[:, start // per_code:end // per_code].contiguous(),
            scales=self.scales[:, g0:g1].contiguous(),
            mins=None if self.mins is None else self.mins[:, g0:g1].contiguous())

    def column_split_error(self, column: int) -> str | None:
        """Why the input features cannot be split before `column` (None: they can)."""
        unit = self.group_size if self.bits == 8 else math.lcm(self.group_size, 32)
        if column % unit:
            return (f"input {column} is inside a group of {self.group_size} inputs"
                    f"{' (4-bit codes are packed in runs of 32)' if self.bits == 4 else ''}")
        return None

    def to(self, device: str | torch.device) -> QuantizedWeight:
        """The same weight with its tensors on device (codes, scales, mins and codebook); plain
        off the CPU (only the CPU's int8 kernels read the interleaved layout)."""
        if self.interleaved and torch.device(device).type != "cpu":
            return self.plain().to(device)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        return dataclasses.replace(self, codes=move(self.codes), scales=move(self.scales),
                                   mins=move(self.mins), codebook=move(self.codebook))

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Rows start..end as views (no copy), or, of an interleaved weight, a plain copy of them."""
        if self.interleaved:
            if start % INTERLEAVED_ROWS == 0 and end % INTERLEAVED_ROWS == 0:  # whole vectors
                g0, g1 = start // INTERLEAVED_ROWS, end // INTERLEAVED_ROWS
                return dataclasses.replace(
                    self, codes=self.codes[g0:g1], scales=self.scales[g0:g1],
                    mins=None if self.mins is None else self.mins[g0:g1]).plain()
            return self.select_rows(torch.arange(start, end, device=self.codes.device))
        return dataclasses.replace(
            self, codes=self.codes[start:end], scales=self.scales[start:end],
            mins=None if self.mins is None else self.mins[start:end])


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one layout stacked along the output features (q/k/v or gate/up fused)."""
    first = parts[0]
    if any(p.layout() != first.layout() for p in parts):
        raise ValueError("only weights of one layout can be stacked")
    sources = ",".join(dict.fromkeys(p.source for p in parts))
    return dataclasses.replace(
        first, codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
        mins=None if first.mins is None else torch.cat([p.mins for p in parts]), source=sources)


QUANTIZATION_BITS = {"int8": 8, "int4": 4}


def quantize(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """Round-to-nearest group-wise quantization of a float weight [N, K].

    8 bits: symmetric (scale = max|w| / 127, codes -127..127), like GGUF's Q8_0.
    4 bits: asymmetric (scale = (max - min) / 15, min = the group's minimum, codes 0..15), like
    Q4_1: a group's range is covered without wasting a code on a sign.
    Scales and mins are stored in float16 where it holds them to full precision (else float32),
    and the codes are rounded against the stored values.
    """
    n, k = weight.shape
    why = check_quantizable((n, k), bits, group_size)
    if why:
        raise ValueError(f"cannot quantize a [{n}, {k}] weight to {bits} bits: {why}")
    grouped = weight.detach().float().reshape(n, k // group_size, group_size)
    if bits == 8:
        scales = grouped.abs().amax(dim=-1) / 127
        scales = scales.to(_scale_dtype(scales))
        codes = torch.round(grouped * _inverse(scales)[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(codes.reshape(n, k), scales.contiguous(), None, 8, group_size, None, "int8")
    low = grouped.amin(dim=-1)
    dtype = _scale_dtype(torch.cat([low, (grouped.amax(dim=-1) - low) / 15]))
    low = low.to(dtype)
    scales = ((grouped.amax(dim=-1) - low.float()) / 15).to(dtype)
    values = torch.round((grouped - low.float()[..., None]) * _inverse(scales)[..., None])
    codes = pack_nibbles(values.clamp(0, 15).to(torch.uint8).reshape(n, k))
    return QuantizedWeight(codes, scales.contiguous(), low.contiguous(), 4, group_size,
                           torch.tensor(LINEAR_CODEBOOK), "int4")


def _scale_dtype(values: torch.Tensor) -> torch.dtype:
    """float16 where it keeps every scale (or min) to its usual 11 bits: nonzero magnitudes
    between float16's smallest normal number and its largest (with room); else float32."""
    magnitudes = values.abs()
    nonzero = magnitudes[magnitudes > 0]
    fits = nonzero.numel() == 0 or (nonzero.min() >= 2**-14 and nonzero.max() < 6e4)
    return torch.float16 if fits else torch.float32


def _inverse(scales: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32 (0 for a group of zeros, whose codes are then 0)."""
    scales = scales.float()
    return torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [N, K] -> the 4-bit layout [N, K/2] (per run of 32: j | (j + 16) << 4)."""
    n, k = values.shape
    runs = values.reshape(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def check_quantizable(shape: tuple[int, int], bits: int, group_size: int) -> str | None:
    """Why a weight of this shape cannot be quantized with these settings (None: it can)."""
    k = shape[1]
    if bits not in (4, 8):
        return f"bits must be 4 or 8, not {bits}"
    if group_size < 1 or k % group_size:
        return f"{k} inputs are not a multiple of the group size {group_size}"
    if bits == 4 and (k % 32 or not (group_size == 16 or group_size % 32 == 0)):
        return "4-bit codes need a group size of 16 or a multiple of 32, and inputs a multiple of 32"
    if bits == 8 and group_size % 16:
        return "8-bit codes need a group size that is a multiple of 16"
    return None
