"""Gated DeltaNet (Qwen3.5's linear attention layers): a causal depthwise convolution over the
projected q/k/v (causal_conv.py), then the gated delta rule, a linear recurrence over a fixed-size
state per head:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

(q and k L2-normalized, q scaled by 1/sqrt(dk); g <= 0 the decay, beta in (0, 1) the write
strength). A request carries two states from step to step: the convolution's last kernel - 1
inputs and S, [value heads, dk, dv]; the model (model/hybrid.py) reads them from the request's
state pages before the layers and writes them back after (model/recurrent_state.py).

Decodes (one token per request) run as one batched recurrence step. A prefill chunk runs in blocks
of CHUNK tokens, each solved at once: unrolling the recurrence inside a block gives, with
gamma_i = g_1 + ... + g_i and S0 the state before the block,

    u_j + sum_{m<j} beta_j exp(gamma_j - gamma_m) (k_j . k_m) u_m = beta_j (v_j - exp(gamma_j) S0^T k_j)

a unit lower-triangular system for all u at once; then o_i = exp(gamma_i) S0^T q_i +
sum_{m<=i} exp(gamma_i - gamma_m) (q_i . k_m) u_m, and the state after the block is
exp(gamma_C) S0 + sum_m exp(gamma_C - gamma_m) k_m u_m^T. Everything in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.causal_conv import conv_chunk, conv_step
from pagedllm.model.config import ModelConfig

CHUNK = 64  # tokens solved at once in a prefill: the triangular system is CHUNK x CHUNK per head


def state_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """One linear layer's recurrent state, as float32 tensors of these shapes: the convolution's
    last inputs [conv channels, kernel - 1] and the delta rule's state [value heads, dk, dv]."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
        config.linear_num_value_heads * config.linear_value_head_dim
    return [(conv_dim, config.linear_conv_kernel_dim - 1),
            (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)]


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.eps = config.rms_norm_eps
        # One matmul for the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a.
        self.in_proj = nn.Linear(config.hidden_size, self.conv_dim + self.value_size + 2 * self.num_v_heads,
                                 bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, config.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm_weight = nn.Parameter(torch.empty(self.v_dim))  # the gated RMSNorm's (no offset)
        self.out_proj = nn.Linear(self.value_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                query_start_loc: list[int]) -> torch.Tensor:
        """x [T, hidden] of B requests laid end to end (query_start_loc, B + 1 offsets);
        conv_state [B, conv channels, kernel - 1] and ssm_state [B, value heads, dk, dv], float32,
        are each request's states before its tokens and are updated in place to after them."""
        mixed, z, b, a = self.in_proj(x).split(
            [self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads], dim=-1)
        beta = b.float().sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        core = torch.empty(x.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32, device=x.device)
        starts, ends = query_start_loc[:-1], query_start_loc[1:]
        if ends[-1] == len(starts):  # decodes only: one recurrence step for the whole batch
            q, k, v = self._heads(conv_step(mixed, conv_state, self.conv_weight, None))
            core[:] = _recurrent_step(q, k, v, decay, beta, ssm_state)
        else:
            for i, (s, e) in enumerate(zip(starts, ends)):
                if e > s:
                    q, k, v = self._heads(conv_chunk(mixed[s:e], conv_state[i], self.conv_weight, None))
                    core[s:e] = _chunked_delta_rule(q, k, v, decay[s:e], beta[s:e], ssm_state[i])
        out = self._gated_norm(core.to(x.dtype), z.view(-1, self.num_v_heads, self.v_dim))
        return self.out_proj(out.reshape(x.shape[0], self.value_size))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [N, value heads, dk] (normalized, q scaled; each key head serves consecutive value
        heads) and v [N, value heads, dv] from the convolved rows."""
        q, k, v = qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        group = self.num_v_heads // self.num_k_heads
        q, k = (_l2norm(t.reshape(-1, self.num_k_heads, self.k_dim)).repeat_interleave(group, dim=1)
                for t in (q, k))
        return q * self.k_dim**-0.5, k, v.reshape(-1, self.num_v_heads, self.v_dim)

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's values, scaled by SiLU of the gate (z)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight * x32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token per request: q, k [B, H, dk], v [B, H, dv], decay and beta [B, H]; state
    [B, H, dk, dv] updated in place. The output [B, H, dv]."""
    state.mul_(decay.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    update = beta[..., None] * (v - predicted)
    state.add_(k[..., :, None] * update[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def _chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One request's L tokens: q, k [L, H, dk], v [L, H, dv], decay and beta [L, H]; state
    [H, dk, dv] updated in place. The output [L, H, dv]. Blocks of CHUNK tokens (module docstring)."""
    out = torch.empty_like(v)
    for s in range(0, q.shape[0], CHUNK):
        qc, kc, vc = (t[s:s + CHUNK].transpose(0, 1) for t in (q, k, v))  # [H, C, d]
        gamma = decay[s:s + CHUNK].t().cumsum(-1)  # [H, C]
        n = gamma.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp(gamma_i - gamma_j) where j <= i, 0 above (masked before exp: no overflow there)
        pair_decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        beta_c = beta[s:s + CHUNK].t()[..., None]  # [H, C, 1]
        system = (beta_c * (kc @ kc.transpose(1, 2)) * pair_decay).tril(-1)
        rhs = beta_c * (vc - gamma.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        scores = (qc @ kc.transpose(1, 2)) * pair_decay
        out[s:s + CHUNK] = (gamma.exp()[..., None] * (qc @ state) + scores @ u).transpose(0, 1)
        to_end = (gamma[:, -1:] - gamma).exp()[..., None]  # [H, C, 1]
        state.mul_(gamma[:, -1].exp()[:, None, None]).add_((kc * to_end).transpose(1, 2) @ u)
    return out
