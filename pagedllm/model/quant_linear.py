"""Linear layers and embeddings over quantized weights (quant_weight.QuantizedWeight).

A QuantLinear picks its kernel by the number of rows it multiplies:
- a few rows (decode steps of a few requests): pagedllm's own kernel (csrc/quant_matmul.cpp) reads
  each quantized weight once per block of up to 8 rows and decodes it in registers: a decode step
  streams a third of the bf16 bytes;
- more rows of bf16 (prefill chunks, decode batches) where the CPU has AMX: csrc/quant_amx.cpp
  dequantizes the weights to bf16 a panel of 32 output features at a time and multiplies them with
  the tile unit;
- more rows otherwise (float32, no AMX): the weight is dequantized a tile of output rows at a time
  into the activations' dtype and multiplied with torch's GEMM, so only one tile of float weights
  exists at a time;
- without the compiled kernels (the portable tier, no compiler, PAGEDLLM_ATTENTION=torch): the
  portable torch path, which dequantizes one tile of output rows at a time (never the whole
  weight) and multiplies it with F.linear; it is also the oracle the kernels are tested against.
The kernels are those of the tier chosen at load (pagedllm.kernels.tiers), read when a layer is
built.
On CUDA every row count goes to the Triton kernel (pagedllm.kernels.triton_quant_matmul), which
dequantizes inside the matmul; the loader keeps GGUF weights quantized there only where Triton is.
Weight-only: activations stay in the model's dtype and products are summed in float32 over the
weights gguf's dequantizer gives (in float32 exactly those; in bf16 rounded to bf16 as the
dequantized model holds them, or exact in the few-rows kernel), so the results match the
dequantized model's up to the order of the sums.

A fused projection (q/k/v, gate/up) whose parts came in different layouts (a GGUF may store v in
Q6_K and q, k in Q4_K) keeps one QuantizedWeight per run of equal layouts and writes each part's
columns of one output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import compiled, matmul, tiers
from pagedllm.model.quant_weight import QuantizedWeight, stack_rows
from pagedllm.utils import cpu_has_native_bf16

# Up to this many rows the few-rows kernel runs; above it AMX where it can, else dequantized tiles
# and a GEMM. Measured on the development machine (docs/benchmarks-notebook.md, Quantized weights): with
# AMX the tile kernel is faster from 5 rows on, without it the few-rows kernel up to 16.
MAX_KERNEL_ROWS = 16
MAX_KERNEL_ROWS_BEFORE_AMX = 4
# Row-interleaved weights (interleave_for_int8): the int8 kernel stays faster than dequantized
# tiles and a GEMM up to far more rows (ep-2c, Zen 4, 2 threads, the default model's four
# projections), at every size a step batches (the bound is only a number above any chunk) except at
# the avx2 tier on a CPU with bf16 math, whose GEMM wins from about 200 rows:
# - avx512 (VNNI) against the bf16 GEMM: 2.3-2.9x at 128 rows, 1.5-1.75x at 512, 1.35-1.56x at 2048;
# - avx2 against the fp32 GEMM a CPU without bf16 math runs: 2.1x at 128, 1.3x at 512, 0.97-1.3x
#   at 2048; against the bf16 one: 1.13-1.24x at 128, 0.85-0.96x at 256.
ANY_CHUNK = 1 << 16


def interleaved_kernel_rows(tier: str) -> int:
    """Up to how many rows a QuantLinear with row-interleaved weights takes the int8 kernel."""
    return 128 if tier == "avx2" and cpu_has_native_bf16() else ANY_CHUNK


# Output rows dequantized at once on the GEMM path: a tile of about 1 MiB of bf16 weights.
TILE_ELEMENTS = 1 << 19
# Weights the portable path dequantizes at once: a 4 MiB float32 tile (and the temporaries of
# QuantizedWeight.dequantize, a few times the tile), whatever the layer's size. Smaller tiles cost
# more in per-op overhead than they save: 1 << 16 made a one-row LM head (49152 x 576) 13x slower.
PORTABLE_TILE_ELEMENTS = 1 << 20


class QuantLinear(nn.Module):
    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = merge_layouts(parts)
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in self.parts)
        if any(p.shape[1] != self.in_features for p in self.parts):
            raise ValueError("the parts of a fused quantized weight must have the same input size")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # Batch-invariant mode (pagedllm.model.batch_invariant): the few-rows kernel for any
        # number of rows, whose sums run in one order per row.
        self.row_invariant = False
        self._gpu_parts = None  # the parts as the GPU kernel takes them, made on its first call
        # The CPU kernels the tier chosen at load runs (tiers.py): no support checks per call.
        kernels = tiers.current()
        self.cpu_kernel = kernels.has("quantized matmul")
        self.amx_kernel = kernels.quant_amx and self.in_features % 32 == 0
        self.max_kernel_rows = MAX_KERNEL_ROWS  # more where the weights are interleaved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if on_gpu(rows):
            out = self._gpu_forward(rows)
        elif not self.cpu_kernel or rows.dtype not in compiled.KERNEL_DTYPES or rows.stride(-1) != 1:
            out = self.portable(rows)
        elif rows.shape[0] <= MAX_KERNEL_ROWS_BEFORE_AMX or self.row_invariant:
            out = self._kernel(rows, matmul.quant_linear)
        elif rows.dtype == torch.bfloat16 and self.amx_kernel:
            out = self._kernel(rows, matmul.quant_linear_amx)
        elif rows.shape[0] <= self.max_kernel_rows:
            out = self._kernel(rows, matmul.quant_linear)
        else:
            out = self._dequantized_tiles(rows)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x [M, in_features]).max(-1).indices: in one compiled call where forward would run
        the few-rows kernel over one part (a greedy decode step's LM head), else forward's own."""
        if (x.dim() == 2 and not on_gpu(x) and x.stride(-1) == 1
                and self.argmax_in_one_call(x.shape[0], x.dtype)):
            return matmul.quant_linear_argmax(x, self.parts[0], self._float_bias())
        return self(x).max(dim=-1).indices

    def argmax_in_one_call(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether argmax over `rows` contiguous CPU rows of dtype is one compiled call: where
        forward would run the few-rows kernel over one part (not AMX's, nor dequantized tiles)."""
        few_rows = (rows <= MAX_KERNEL_ROWS_BEFORE_AMX or self.row_invariant
                    or (not (dtype == torch.bfloat16 and self.amx_kernel) and rows <= self.max_kernel_rows))
        return len(self.parts) == 1 and self.cpu_kernel and dtype in compiled.KERNEL_DTYPES and few_rows

    def _gpu_forward(self, rows: torch.Tensor) -> torch.Tensor:
        from pagedllm.kernels import triton_quant_matmul  # Triton only where a GPU runs

        if not triton_quant_matmul.supports(rows, self.parts):
            return self.portable(rows)
        if self._gpu_parts is None:
            self._gpu_parts = triton_quant_matmul.prepare(self.parts)
        return triton_quant_matmul.linear(rows, self._gpu_parts, self.bias)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole float weight [out_features, in_features] (tests, and the GPU without Triton)."""
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def portable(self, rows: torch.Tensor) -> torch.Tensor:
        """The portable path, and the oracle of the kernels: torch alone, the weight dequantized
        (QuantizedWeight.dequantize, gguf's values) one tile of output rows at a time, so only
        one tile of float weights exists at a time whatever the layer's size."""
        out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype, device=rows.device)
        tile_rows = portable_tile_rows(self.in_features)
        start = 0
        for part in self.parts:
            for lo in range(0, part.shape[0], tile_rows):
                hi = min(lo + tile_rows, part.shape[0])
                weight = part.rows(lo, hi).dequantize(rows.dtype)
                bias = None if self.bias is None else self.bias[start + lo:start + hi].to(rows.dtype)
                out[:, start + lo:start + hi] = F.linear(rows, weight, bias)
            start += part.shape[0]
        return out

    def _kernel(self, rows: torch.Tensor, kernel) -> torch.Tensor:
        # A decode step calls this some hundred times: the Python around the kernel is kept short.
        out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype)
        if len(self.parts) == 1:
            kernel(rows, self.parts[0], self._float_bias(), out)
            return out
        bias, start = self._float_bias(), 0
        for part in self.parts:
            end = start + part.shape[0]
            kernel(rows, part, None if bias is None else bias[start:end], out[:, start:end])
            start = end
        return out

    def _float_bias(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return self.bias if self.bias.dtype == torch.float32 else self.bias.float()

    def _dequantized_tiles(self, rows: torch.Tensor) -> torch.Tensor:
        """The GEMM path. bf16 rows on a CPU without bf16 math multiply in fp32 (the weights'
        exact values, the product rounded to bf16 once): torch's bf16 GEMM there converts inside
        and ran a 128-token prefill of the default model 4x slower than fp32 (AVX2 EPYC)."""
        out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype)
        compute = torch.float32 if rows.dtype == torch.bfloat16 and not cpu_has_native_bf16() else rows.dtype
        x = rows.to(compute)
        tile_rows = max(16, TILE_ELEMENTS // self.in_features // 16 * 16)  # whole interleaved vectors
        start = 0
        for part in self.parts:
            for lo in range(0, part.shape[0], tile_rows):
                hi = min(lo + tile_rows, part.shape[0])
                weight = matmul.quant_dequantize(part.rows(lo, hi), compute)
                bias = None if self.bias is None else self.bias[start + lo:start + hi].to(compute)
                out[:, start + lo:start + hi] = F.linear(x, weight, bias)
            start += part.shape[0]
        return out

    def extra_repr(self) -> str:
        kinds = ", ".join(dict.fromkeys(p.source for p in self.parts))
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={kinds}"


class QuantEmbedding(nn.Module):
    """Embedding rows looked up in a quantized table and dequantized to dtype."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.cpu_kernel = tiers.current().has("quantized matmul")  # chosen at load (tiers.py)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.in_one_call:  # gathered and dequantized in one call
            rows = matmul.quant_embedding(self.weight_q, ids.to(torch.int64).contiguous(), self.dtype)
        else:
            rows = self.weight_q.select_rows(ids).dequantize(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    @property
    def in_one_call(self) -> bool:
        """Whether a lookup is one compiled call (quant_embedding)."""
        return (self.cpu_kernel and self.weight_q.codes.device.type == "cpu"
                and self.dtype in compiled.KERNEL_DTYPES)


def interleave_for_int8(model: nn.Module) -> int:
    """Give the quantized weights of a bf16 model the row-interleaved layout where the chosen tier's
    int8 kernel reads it (tiers.KernelChoice.int8_activations; quant_weight.py, the layout): in
    place of the plain one, so no weight is held twice, a tied embedding table included (its
    lookups gather plain rows). Every other path reads plain rows of it (QuantizedWeight.rows).
    Returns how many weights changed layout."""
    choice = tiers.current()
    if not choice.int8_activations:
        return 0
    # By id, each with the plain weight it replaces (kept alive here, so no id is reused).
    done: dict[int, tuple[QuantizedWeight, QuantizedWeight]] = {}

    def swapped(weight: QuantizedWeight) -> QuantizedWeight:
        return done[id(weight)][1] if id(weight) in done else weight
    for module in model.modules():
        if isinstance(module, QuantLinear):
            for i, part in enumerate(module.parts):
                if id(part) not in done and part.interleavable() and part.codes.device.type == "cpu":
                    done[id(part)] = (part, part.interleave())
                module.parts[i] = swapped(part)
            if all(part.interleaved for part in module.parts):
                module.max_kernel_rows = interleaved_kernel_rows(choice.tier)
    for module in model.modules():
        if isinstance(module, QuantEmbedding):
            module.weight_q = swapped(module.weight_q)
    return len(done)


def portable_tile_rows(in_features: int) -> int:
    """Output rows the portable path dequantizes at once: about PORTABLE_TILE_ELEMENTS weights
    (16 rows at least)."""
    return max(16, PORTABLE_TILE_ELEMENTS // in_features)


def on_gpu(rows: torch.Tensor) -> bool:
    """Whether a matmul runs on the GPU's kernel: activations on a CUDA device."""
    return rows.is_cuda


def merge_layouts(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Adjacent parts of one layout stacked into one (one kernel call for q/k/v when they agree)."""
    merged: list[list[QuantizedWeight]] = []
    for part in parts:
        if merged and merged[-1][0].layout() == part.layout():
            merged[-1].append(part)
        else:
            merged.append([part])
    return [group[0] if len(group) == 1 else stack_rows(group) for group in merged]
