"""The modules that make a rank's share of the model compute the whole model's result: each wraps
the module the loader built (a float, prepacked or quantized one alike) and adds the collective
its split needs (pagedllm.distributed.sharding says which weights are split how).

`parallelize` puts them in place on a loaded model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.distributed.sharding import ShardPlan


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's input columns: its partial product, summed over the ranks
    by one all-reduce; the bias (whole on every rank) added once, after the sum."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.bias = inner.bias
        inner.bias = None
        self.inner = inner  # its weights may yet be prepacked in place (prepack_for_cpu)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        self.group.all_reduce(out)
        return out if self.bias is None else out + self.bias


class ReducedOutput(nn.Module):
    """A module over this rank's share whose partial outputs the ranks sum (a mixture-of-experts
    layer: each rank runs every picked expert over its own intermediate columns)."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        self.group.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's vocabulary [start, end): a token outside it gets zeros
    here, and the all-reduce brings every token the row of the one rank that holds it."""

    def __init__(self, inner: nn.Module, start: int, end: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.start, self.end = start, end
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        """The float table (a tied LM head multiplies by it)."""
        return self.inner.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        rows = self.inner(local.masked_fill(outside, 0))
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        self.group.all_reduce(rows)
        return rows


class VocabGather:
    """Rank 0's full logits from every rank's columns (each rank's vocabulary rows of the LM
    head); None on the other ranks. gloo gathers tensors of one shape: narrower shares are padded."""

    def __init__(self, group: TensorParallelGroup, widths: list[int]) -> None:
        self.group = group
        self.widths = widths

    def __call__(self, logits: torch.Tensor) -> torch.Tensor | None:
        padded = F.pad(logits, (0, max(self.widths) - logits.shape[-1])).contiguous()
        parts = self.group.gather(padded)
        if parts is None:
            return None
        return torch.cat([part[:, :width] for part, width in zip(parts, self.widths)], dim=-1)


def parallelize(model: nn.Module, plan: ShardPlan, rank: int, group: TensorParallelGroup) -> None:
    """Wrap a loaded shard's row-parallel layers, embedding and LM head in their collectives."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group)
        if hasattr(layer.mlp, "down_proj"):
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group)
        else:
            layer.mlp = ReducedOutput(layer.mlp, group)
    start, end = plan.shares[rank].vocab
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, start, end, group)
    model.vocab_gather = VocabGather(group, [e - s for s, e in (sh.vocab for sh in plan.shares)])
