"""The portable tier's quantized matmul for bf16 models: torch's own int4 CPU kernel
(`torch._weight_int4pack_mm_for_cpu`, the one gpt-fast and torchao call), over weights repacked
into its layout once, at load.

Without compiled kernels of ours (the portable tier: cpu_isa=portable, an ARM or pre-AVX2 CPU, no
compiler) QuantLinear's torch path dequantizes a tile of the weight on every call: the default
GGUF then decoded at 2-4 tok/s. torch's kernel reads the 4-bit codes as they are and runs at the
speed of reading them (ep-2c: gate/up 3072 x 576, one row, 56 us; docs/cpu-tiers.md).

Its format: 4-bit codes q in 0..15 with, per group of 32, 64, 128 or 256 inputs and per output
row, a scale and a zero (bf16, the activations' dtype): weight = (q - 8) * scale + zero.
Our layouts (quant_weight.py) map onto it exactly but for the rounding of scale and zero to bf16
(the bf16 model's dequantized weights are rounded to bf16 too):
- 4-bit codes over a linear codebook (Q4_0: -8..7; Q4_1, Q4_K and int4: 0..15), value = q + c:
  weight = s * (q + c) + m = (q - 8) * s + (s * (8 + c) + m);
- int8 codes (Q8_0, int8, the GGUF types gguf_repack.py gives int8 codes) split into two 4-bit halves,
  v = 16 * hi + lo with hi in -8..7 and lo in 0..15: rows (hi + 8) with scale 16 s and zero 0,
  and rows lo with scale s and zero 8 s + m, multiplied in one call and added.
A QuantLinear whose parts all fit (rows a multiple of 16, groups of 32..256) is replaced by a
TorchInt4Linear at load (pack_for_torch, from the model's prepack_for_cpu); its plain codes are
then dropped, unless an embedding table shares them (a tied LM head). The others keep the tile
path. QuantLinear.portable stays the oracle this is tested against (tests/model/test_torch_int4_linear.py).
float32 models keep the exact tile path: torch's kernel is scalar for float32 (19x slower than
bf16 on ep-2c), so the portable tier loads a GGUF in bf16 under dtype auto (loader.resolve_model_dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels import tiers
from pagedllm.model.quant_weight import QuantizedWeight

TORCH_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's int4 kernel takes
ROW_MULTIPLE = 16  # its packing needs output rows in multiples of 16
# Rows packed at once: a multiple of the kernel's row blocks (32 or 64, by the CPU), so the chunks'
# packings concatenate into the whole weight's (tests/model/test_torch_int4_linear.py checks it).
PACK_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class Int4Pack:
    """One part of a projection in torch's int4 layout: `weight` its packed codes, `scales_zeros`
    [K / group_size, rows, 2] bf16; `split`: int8 codes as two halves of `rows` (hi rows, then lo)."""

    weight: torch.Tensor
    scales_zeros: torch.Tensor
    group_size: int
    rows: int
    split: bool


def packable(part: QuantizedWeight) -> bool:
    """Whether torch's int4 kernel takes this weight (the module docstring says how)."""
    rows, _ = part.shape
    if part.interleaved or part.group_size not in TORCH_GROUP_SIZES or rows % ROW_MULTIPLE:
        return False
    if part.bits == 8:
        return True
    book = part.codebook
    return book is not None and torch.equal(book - book[0], torch.arange(16, dtype=book.dtype))


def pack(part: QuantizedWeight) -> Int4Pack:
    """part in torch's int4 layout (packable(part) must hold), packed PACK_CHUNK_ROWS rows at a
    time so that loading holds no float or int32 copy of a whole weight."""
    rows, k = part.shape
    scale = part.scales.float()
    offset = torch.zeros_like(scale) if part.mins is None else part.mins.float()
    if part.bits == 4:
        base = float(part.codebook[0])
        scales, zeros = scale, scale * (8 + base) + offset
    else:
        scales = torch.cat([16 * scale, scale])
        zeros = torch.cat([torch.zeros_like(scale), 8 * scale + offset])
    total = scales.shape[0]
    packed = []
    for lo in range(0, total, PACK_CHUNK_ROWS):
        codes = _codes(part, lo, min(lo + PACK_CHUNK_ROWS, total))
        packed.append(torch._convert_weight_to_int4pack_for_cpu(codes, 1))
    weight = torch.cat(packed)
    scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Pack(weight, scales_zeros, part.group_size, rows, part.bits == 8)


def _codes(part: QuantizedWeight, lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi of the codes torch's kernel reads, int32 in 0..15: for int8 codes the hi halves
    of every row, then the lo halves (rows N..2N)."""
    if part.bits == 4:
        return (part.rows(lo, hi).values() - part.codebook[0]).to(torch.int32)
    n = part.shape[0]
    pieces = []
    if lo < n:  # hi halves: v // 16 in -8..7, stored + 8
        pieces.append(torch.floor(part.rows(lo, min(hi, n)).values() / 16) + 8)
    if hi > n:  # lo halves: v - 16 * (v // 16) in 0..15
        values = part.rows(max(lo, n) - n, hi - n).values()
        pieces.append(values - 16 * torch.floor(values / 16))
    return torch.cat(pieces).to(torch.int32)


class TorchInt4Linear(nn.Module):
    """A QuantLinear's projection on torch's int4 kernel (bf16 activations on the CPU)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.packs = [pack(part) for part in linear.parts]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.source = ", ".join(dict.fromkeys(p.source for p in linear.parts))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        outs = [self._part(rows, p) for p in self.packs]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    @staticmethod
    def _part(rows: torch.Tensor, p: Int4Pack) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(rows, p.weight, p.group_size, p.scales_zeros)
        if not p.split:
            return out
        return out[:, :p.rows].float().add_(out[:, p.rows:]).to(torch.bfloat16)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds (LlamaForCausalLM.weight_bytes)."""
        return [t for p in self.packs for t in (p.weight, p.scales_zeros)]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.source}"


def runs_here(model_dtype: torch.dtype) -> bool:
    """Whether a model of this dtype takes torch's int4 kernel: bf16 on a tier without our
    quantized matmul (tiers.py)."""
    return model_dtype == torch.bfloat16 and not tiers.current().has("quantized matmul")


def pack_for_torch(model: nn.Module) -> int:
    """Replace every QuantLinear whose parts are all packable by a TorchInt4Linear (the tier must
    have no quantized matmul of ours: runs_here). Returns how many were replaced."""
    from pagedllm.model.quant_linear import QuantLinear

    replacements: dict[int, TorchInt4Linear] = {}  # by id: a module under two names (an LM head) once
    for module in list(model.modules()):
        for name, child in list(module._modules.items()):  # every name (named_children: once per module)
            if id(child) not in replacements and not (type(child) is QuantLinear and all(
                    packable(p) and p.codes.device.type == "cpu" for p in child.parts)):
                continue
            if id(child) not in replacements:
                replacements[id(child)] = TorchInt4Linear(child)
            setattr(module, name, replacements[id(child)])
    return len(replacements)
