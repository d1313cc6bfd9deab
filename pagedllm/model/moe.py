"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks top_k of num_experts gated
MLPs for each token, and the token's output is their outputs weighted by the router's scores.

The layer is fused over the batch: the (token, expert) pairs of the whole flat batch are sorted by
expert once, and each expert that got any token runs one matmul over all of its tokens (a decode
step of 64 sequences with top-2 of 8 experts is 8 matmuls of ~16 rows, not 128 of one row); an
expert no token picked costs nothing, and a token that lands on an expert twice in one batch is
just two rows of it. Outputs are summed back with index_add_ in expert order, the order
transformers' reference loop uses, so float32 results agree to rounding.

Each expert is an ordinary gated MLP module (its gate/up fused), so whatever the loader does to an
MLP it does to an expert: bf16 weights prepacked for the CPU's kernels, a GGUF's quantized expert
tensors kept quantized (gguf_file.py cuts llama.cpp's stacked [E, I, H] tensors per expert),
tensor parallelism cutting each expert's columns (distributed/sharding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.config import ModelConfig


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): softmax over all experts in float32, the top k,
    renormalized to sum to one where the model says so (Mixtral always; Qwen3-MoE by
    norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """experts: num_experts gated MLPs (llama.MLP, moe_intermediate_size wide), made by the caller
    so that each expert is an ordinary MLP: prepacked for the CPU's bf16 kernels, or kept
    quantized from a GGUF, like any other."""

    def __init__(self, config: ModelConfig, experts: list[nn.Module]):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.normalize)
        return self.run_experts(x, weights.to(x.dtype), experts)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert[experts[t, k]](x[t]), each expert once per batch."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair indices (t * k + j), grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // self.top_k
            out.index_add_(0, tokens, self.experts[expert](x[tokens]) * pair_weights[pairs, None])
        return out
