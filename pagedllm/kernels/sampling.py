"""The compiled sampling of rows with a temperature alone (csrc/sample.cpp), from the chosen tier's
extension (tiers.py)."""

from __future__ import annotations

import torch

from pagedllm.kernels import tiers


def sample_plain(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor,
                 uniforms: torch.Tensor) -> torch.Tensor:
    """A token for each of `rows` of float32 logits [N, V], at its temperature (float32), drawn
    by inverse CDF from its uniform number (float64): sampler._inverse_cdf over softmax(l / T)."""
    return tiers.current().ops.sample_plain.default(logits, rows, temperatures, uniforms)
