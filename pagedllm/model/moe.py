"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek, gpt-oss): a router
picks top_k of num_experts gated MLPs for each token, and the token's output is their outputs
weighted by the router's scores; plus, where the model has one, a shared expert every token goes
through (DeepSeek's added as it is, Qwen2-MoE's scaled by sigmoid(shared_expert_gate(x)), a
one-output gate of its own).

The layer is fused over the batch: the (token, expert) pairs of the whole flat batch are sorted by
expert once, and each expert that got any token runs one matmul over all of its tokens (a decode
step of 64 sequences with top-2 of 8 experts is 8 matmuls of ~16 rows, not 128 of one row); an
expert no token picked costs nothing, and a token that lands on an expert twice in one batch is
just two rows of it. Each (token, pick) pair's weighted output gets a row of its own and a token's
k rows are summed, so float32 results agree with transformers' reference loop to rounding.

Each expert is an ordinary gated MLP module (its gate/up fused), so whatever the loader does to an
MLP it does to an expert: bf16 weights prepacked for the CPU's kernels, a GGUF's quantized expert
tensors kept quantized (gguf_file.py cuts llama.cpp's stacked [E, I, H] tensors per expert),
tensor parallelism cutting each expert's columns (distributed/sharding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import tiers
from pagedllm.model.config import ModelConfig


def route(router_logits: torch.Tensor, top_k: int, normalize: bool, method: str = "greedy",
          scoring: str = "softmax", n_group: int = 1, topk_group: int = 1, scale: float = 1.0,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from the router's logits, as each family does:
    - greedy (Mixtral, Qwen3-MoE, DeepSeek-V2): softmax over all experts in float32, the top k;
    - group_limited_greedy (DeepSeek-V2): only experts of the topk_group groups whose best score
      is highest;
    - noaux_tc (DeepSeek-V3): sigmoid scores; groups ranked by the sum of their two best biased
      scores, experts picked by biased score, weighted by their unbiased one;
    - topk_softmax (gpt-oss): the top k logits, softmaxed among themselves (the same weights as
      greedy renormalized, up to rounding: computed as transformers does).
    Then renormalized to sum to one where the model says so, and multiplied by scale."""
    logits = router_logits.float()
    if method == "topk_softmax":
        top = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top.values, dim=-1) * scale, top.indices
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if method in ("group_limited_greedy", "noaux_tc") and n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if method == "noaux_tc" \
            else grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1)
        fill = 0.0 if method == "group_limited_greedy" else float("-inf")
        choice = grouped.masked_fill(keep.unsqueeze(-1) == 0, fill).view_as(choice)
    experts = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


class Router(nn.Module):
    """The router's weight [num_experts, hidden] (and gpt-oss's bias), applied in float32 (as
    transformers does): not an nn.Linear, so the CPU's bf16 prepacking leaves it alone; a one-row
    bf16 matmul through oneDNN costs more than this whole product in float32."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # float64 stays (the tests' reference)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)


class SparseMoE(nn.Module):
    """experts: num_experts gated MLPs (llama.MLP, moe_intermediate_size wide), made by the caller
    so that each expert is an ordinary MLP: prepacked for the CPU's bf16 kernels, or kept
    quantized from a GGUF, like any other."""

    def __init__(self, config: ModelConfig, experts: list[nn.Module], shared: nn.Module | None = None):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.routing = dict(normalize=config.norm_topk_prob, method=config.topk_method,
                            scoring=config.scoring_func, n_group=config.n_group,
                            topk_group=config.topk_group, scale=config.routed_scaling_factor)
        self.gate = Router(config.hidden_size, config.num_experts, config.router_bias)
        # DeepSeek-V3 biases the choice of experts (not their weights) by a learned score each.
        self.score_bias = (nn.Parameter(torch.zeros(config.num_experts))
                           if config.topk_method == "noaux_tc" else None)
        self.experts = nn.ModuleList(experts)
        self.shared_experts = shared  # one MLP every token goes through too
        # Qwen2-MoE scales the shared expert's output per token: a Router of one output, in float32.
        self.shared_expert_gate = (Router(config.hidden_size, 1)
                                   if shared is not None and config.arch.shared_expert_gate else None)
        # Greedy softmax routing on the CPU: the tier's compiled router (csrc/moe_route.cpp), one
        # call instead of route()'s ten torch operations; a decode step's one call takes it too.
        ops = tiers.current().ops
        greedy_softmax = config.topk_method == "greedy" and config.scoring_func == "softmax"
        self.route_kernel = (ops.moe_route if hasattr(ops, "moe_route") and self.score_bias is None
                             and self.gate.bias is None and greedy_softmax else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.route_kernel is not None and x.device.type == "cpu" and x.dim() == 2
                and x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1):
            weights, experts = self.route_kernel(x, self.gate.weight, self.top_k, self.routing["normalize"],
                                                 float(self.routing["scale"]))
        else:
            weights, experts = route(self.gate(x), self.top_k, bias=self.score_bias, **self.routing)
            weights = weights.to(x.dtype)
        out = self.run_experts(x, weights, experts)
        return out if self.shared_experts is None else out + self.shared_output(x)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, scaled by its gate where it has one."""
        shared = self.shared_experts(x)
        if self.shared_expert_gate is None:
            return shared
        return torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype) * shared

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert[experts[t, k]](x[t]), each expert once per batch."""
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair indices (t * k + j), grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.reshape(-1, 1)
        # Each (token, pick) pair's weighted output in its own row, then the k rows of a token
        # summed: no scatter-add (index_add_ in bf16 costs milliseconds a call on the CPU).
        pair_out = x.new_empty(tokens * top_k, x.shape[-1])
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            pair_out[pairs] = self.experts[expert](x[pairs // top_k]) * pair_weights[pairs]
        return pair_out.view(tokens, top_k, -1).sum(dim=1)
