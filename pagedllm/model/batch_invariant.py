"""Batch-invariant mode (EngineConfig.batch_invariant, `--batch-invariant`): a request's greedy
output does not depend on what else is in its batch, on how its prompt is cut into chunks, or on
whether it was preempted and recomputed, in bfloat16 as in float32.

Why outputs move otherwise: a bf16 forward pass sums in float32 and rounds; the order of a sum
changes its rounding, and the kernels choose their order by the shape of the call. A matmul of
3 rows and one of 300 may block K differently (oneDNN picks its kernel by M; the prepacked layout
sums in another order at some sizes); attention takes per-row dot products for a decode but
transposed-K tiles or the AMX tile unit for a prefill chunk. A token recomputed after preemption,
or a prompt chunked differently, then gets logits one bf16 step apart, and greedy decoding may
pick another token. Nothing is corrupted, but the text depends on the load.

What this mode fixes, per row:
- matmuls over float weights: InvariantLinear calls the GEMM on tiles of INVARIANT_ROWS rows
  (the last one padded with zeros), so the library sees one shape whatever the batch and picks one
  kernel and one blocking; a row's result never depends on other rows of its call (no reduction
  crosses rows). Weights are not prepacked (the packed kernel sums in another order at some M).
- matmuls over quantized weights: pagedllm's few-rows kernel for every row count (csrc/
  quant_matmul.cpp: each output is one fp32 sum over K in a fixed order, whatever the block of
  rows), never the AMX or dequantize-and-GEMM paths.
- attention: the compiled kernel's row-invariant entry (paged_attention_invariant): every query
  row takes the vector path's per-row dot products and key tiles start at multiples of 16, so a
  row's online softmax runs the same steps in a decode, a chunk of any size, or a recompute.
- norms, rotary, activations, the embedding and the sampler's greedy pick are per row already
  (the fused kernels normalise one row at a time; torch's vectorised elementwise ops treat a
  tensor's tail like its body).

What it does not cover, refused at start-up with a ValueError: GPUs (the Triton kernel and
cuBLAS choose their own orders), CPU tiers without pagedllm's compiled attention, quantized
matmuls and norms (tiers.LAYER_FAMILIES: the portable tier; its torch attention batches its
matmuls), float16, head sizes the kernel is not compiled for, and attention sinks (gpt-oss: the
torch attention path only). (The avx2 tier's attention is
row-invariant whatever the call: csrc/attention_avx2.cpp.)

The cost is prefill speed (docs/reliability.md, `pagedllm bench throughput --batch-invariant`):
attention's prefill runs at the decode path's per-row speed, quantized prefill on the few-rows
kernel, and float matmuls in tiles of INVARIANT_ROWS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import tiers
from pagedllm.kernels.attention import cpu_attention
from pagedllm.model.quant_linear import QuantLinear

# Rows per GEMM call on float weights. A decode step of up to 64 requests is one call, about as
# fast as one of a single row (the weights' reading sets its pace); a prefill chunk of 2048 tokens
# is 32 calls, each reading the weights again (16-row tiles measured 2-3x slower there).
INVARIANT_ROWS = 64
_DTYPES = (torch.float32, torch.bfloat16)


class InvariantLinear(nn.Module):
    """F.linear on tiles of INVARIANT_ROWS rows: the same GEMM call shape whatever the batch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        out = torch.empty(num_rows, self.out_features, dtype=rows.dtype, device=rows.device)
        full = num_rows - num_rows % INVARIANT_ROWS
        for lo in range(0, full, INVARIANT_ROWS):
            out[lo:lo + INVARIANT_ROWS] = F.linear(rows[lo:lo + INVARIANT_ROWS], self.weight, self.bias)
        if full < num_rows:
            tail = rows.new_zeros(INVARIANT_ROWS, self.in_features)
            tail[:num_rows - full] = rows[full:]
            out[full:] = F.linear(tail, self.weight, self.bias)[:num_rows - full]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={INVARIANT_ROWS}"


def check_batch_invariant(model: nn.Module) -> None:
    """ValueError saying why this model, here, cannot run batch-invariant; None where it can."""
    config = model.config
    weight = model.norm.weight
    if weight.device.type != "cpu":
        raise ValueError(f"batch_invariant runs on the CPU only (the model is on {weight.device}); "
                         "use --device cpu or leave batch_invariant off")
    if weight.dtype not in _DTYPES:
        raise ValueError(f"batch_invariant supports bfloat16 and float32, not {weight.dtype}")
    if config.arch.attention_sinks:
        raise ValueError(f"batch_invariant: {config.architecture}'s attention sinks run on the torch "
                         "attention path, which is not row-invariant; leave batch_invariant off")
    probe = torch.empty(1, config.num_attention_heads, config.head_dim, dtype=weight.dtype)
    if not tiers.current().runs_layers:
        raise ValueError("batch_invariant needs pagedllm's compiled CPU kernels for attention, quantized "
                         f"matmuls and norms, unavailable here: {tiers.unavailable_reason()}")
    if not cpu_attention.supports(probe, torch.empty(1, 1, config.num_key_value_heads, config.head_dim,
                                                  dtype=weight.dtype)):
        raise ValueError(f"batch_invariant: the compiled attention kernel does not take head_dim "
                         f"{config.head_dim} with {config.num_attention_heads} heads over "
                         f"{config.num_key_value_heads} kv heads")


def make_batch_invariant(model: nn.Module) -> None:
    """Switch a loaded LlamaForCausalLM's matmuls to batch-invariant ones, in place (instead of
    prepack_for_cpu); attention follows AttentionMetadata.batch_invariant, which the runner sets.
    ValueError, before anything changes, where the mode is not covered."""
    check_batch_invariant(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, InvariantLinear(child.weight, child.bias))
            elif isinstance(child, QuantLinear):
                child.row_invariant = True
    head = getattr(model, "_packed_lm_head", None)
    if isinstance(head, QuantLinear):
        head.row_invariant = True
    elif model.lm_head is not None:
        model.set_lm_head_kernel(model.lm_head)  # made invariant by the loop above
    else:
        model.set_lm_head_kernel(InvariantLinear(model.embed_tokens.weight, None))
