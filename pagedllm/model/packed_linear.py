"""bf16 linear weights packed once for the CPU's matmul kernels, so no call reorders its weight.

Two packings, one copy of the weight each way:
- AMX (pagedllm/kernels/csrc/dense_amx.cpp), where the CPU has AMX-BF16 and the input size is a
  multiple of 32: panels of 32 output features in the order the tile loads read them. A decode
  step streams every weight from memory once, and this kernel streams them faster than oneDNN's;
  a prefill chunk of hundreds of rows multiplies 10-30% faster, and one of thousands 0-15% slower
  (docs/benchmarks-notebook.md, CPU speed); each row's sums run in one order whatever its batch.
- oneDNN's blocked layout otherwise (`mkldnn._reorder_linear_weight` + `_linear_pointwise`, as
  torch.compile's CPU freezing does): plain F.linear reorders the weight on every call (1.5-1.9x
  slower at decode batch sizes).
On AMX a fused gate/up projection of a SwiGLU MLP also applies SiLU-and-mul as it stores its
tiles (gated_silu: out [M, I], the 2 I-wide intermediate never written).
PAGEDLLM_DENSE_AMX=0 keeps oneDNN's. Both sum in fp32 in another order than F.linear, so an
element now and then comes out one bf16 step apart from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import matmul, tiers


class PackedLinear(nn.Module):
    """nn.Linear over a bf16 weight packed for the CPU kernels; the results of F.linear, or with
    gated_silu (asked for a [gate | up] weight, granted on AMX only) those of silu_and_mul after it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_num_tokens: int,
                 gated_silu: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.amx = self.in_features % 32 == 0 and matmul.dense_amx_available()  # the tier's choice
        self.gated_silu = gated_silu and self.amx
        if self.gated_silu:
            self.out_features //= 2
        if self.amx:
            self.packed_weight = matmul.dense_amx_pack(weight.detach(), self.gated_silu)
            self._mm = tiers.current().ops.dense_amx_mm.default  # looked up once, not per call
            self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max_num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.amx:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        if x.dim() == 2 and x.stride(-1) == 1:  # the model's case: one call (121 a decode step)
            return self._mm(x, self.packed_weight, self.bias_f32, self.out_features, self.gated_silu)
        rows = x.reshape(-1, self.in_features).contiguous()
        out = self._mm(rows, self.packed_weight, self.bias_f32, self.out_features, self.gated_silu)
        return out.view(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).float().max(-1).indices for x [M, in_features]: on AMX without storing the
        outputs (an LM head under greedy sampling: 64 rows x 49k logits not written, cast, read)."""
        if not self.amx or self.gated_silu:
            return self(x).float().max(dim=-1).indices
        rows = x if x.stride(-1) == 1 else x.contiguous()
        return matmul.dense_amx_argmax(rows, self.packed_weight, self.bias_f32, self.out_features)


def can_pack(max_num_tokens: int) -> bool:
    """Whether this torch build (and the kernels) pack and run a bf16 linear correctly here."""
    try:
        for width in (32, 40):  # the AMX packing where it runs, and oneDNN's (40: not a multiple of 32)
            x = torch.arange(-5 * width // 2, 5 * width // 2).reshape(5, width).to(torch.bfloat16) / 64
            weight = torch.arange(48 * width).reshape(48, width).remainder(7).to(torch.bfloat16) - 3
            if not torch.equal(PackedLinear(weight, None, max_num_tokens)(x), F.linear(x, weight)):
                return False
        return True
    except (AttributeError, RuntimeError):
        return False
