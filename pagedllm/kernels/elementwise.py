"""The compiled elementwise fusions around a layer's matmuls (csrc/fused_ops.cpp): RMSNorm with
the residual add, rotary in place on the q/k/v rows, SiLU-and-mul."""

from __future__ import annotations

import torch

from pagedllm.kernels import compiled


def fused_ops_support(x: torch.Tensor) -> bool:
    """Whether the fused elementwise ops can take this activation (builds the kernels on first use)."""
    return x.device.type == "cpu" and x.dtype in compiled.KERNEL_DTYPES and compiled.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim of [T, H], rounded as the torch RMSNorm rounds."""
    return torch.ops.pagedllm_cpu.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual)."""
    torch.ops.pagedllm_cpu.add_rms_norm_(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim: [T, I]."""
    return torch.ops.pagedllm_cpu.silu_and_mul(gate_up)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotary embedding in place on the first num_heads heads of each row of qkv [T, width]."""
    torch.ops.pagedllm_cpu.rotary_(qkv, cos, sin, num_heads, head_dim)
