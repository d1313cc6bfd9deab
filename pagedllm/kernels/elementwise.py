"""The compiled elementwise fusions around a layer's matmuls (csrc/fused_ops.cpp): RMSNorm with
the residual add, rotary in place on the q/k/v rows, SiLU-and-mul; from the chosen tier's
extension (tiers.py)."""

from __future__ import annotations

import torch

from pagedllm.kernels import compiled, tiers


def fused_ops_chosen() -> bool:
    """Whether the chosen tier runs the fused elementwise ops (a layer asks once, when built)."""
    return tiers.current().has("norms/rotary")


def takes(x: torch.Tensor) -> bool:
    """Whether the fused ops take this activation (device and dtype; the tier is chosen apart)."""
    return x.device.type == "cpu" and x.dtype in compiled.KERNEL_DTYPES


def fused_ops_support(x: torch.Tensor) -> bool:
    """Whether the fused elementwise ops can take this activation under the chosen tier."""
    return takes(x) and fused_ops_chosen()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim of [T, H], rounded as the torch RMSNorm rounds."""
    return tiers.current().ops.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual)."""
    tiers.current().ops.add_rms_norm_(x, residual, weight, eps)


def rms_norm_heads_(rows: torch.Tensor, first: int, count: int, head_dim: int, weight: torch.Tensor,
                    eps: float) -> None:
    """In place: heads first .. first + count of each row of rows [T, width], each normalized over
    its head_dim by weight (the same values as rms_norm over those heads as rows)."""
    tiers.current().ops.rms_norm_heads_(rows, first, count, head_dim, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim: [T, I]."""
    return tiers.current().ops.silu_and_mul(gate_up)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotary embedding in place on the first num_heads heads of each row of qkv [T, width]."""
    tiers.current().ops.rotary_(qkv, cos, sin, num_heads, head_dim)
