"""Mamba2 (Granite 4's recurrent layers): a causal depthwise convolution over the projected x, B
and C (causal_conv.py), then a selective state space scan with one scalar decay per head:

    dt_t = clamp(softplus(dt_t + dt_bias), time_step_limit),   a_t = dt_t * A   (A = -exp(A_log))
    h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t

per head, h [head_dim, d_state], B and C shared by the heads of a group. The output is gated
(y * silu(z)), RMS-normalized per group, and projected back. A request carries its conv state and h
from step to step in its state pages (model/recurrent_state.py), as a Gated DeltaNet does.

Decodes run as one batched step. A prefill chunk runs in blocks of CHUNK tokens, each at once:
with gamma_i = a_1 + ... + a_i and h0 the state before the block,

    y_i = exp(gamma_i) h0 C_i + sum_{j<=i} exp(gamma_i - gamma_j) (C_i . B_j) dt_j x_j + D x_i
    h_C = exp(gamma_C) h0 + sum_j exp(gamma_C - gamma_j) dt_j x_j B_j^T

Everything in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.causal_conv import conv_chunk, conv_step
from pagedllm.model.config import ModelConfig

CHUNK = 64


def state_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """One Mamba2 layer's state: the convolution's last inputs [conv channels, kernel - 1] and h
    [heads, head_dim, d_state]."""
    intermediate = config.mamba_n_heads * config.mamba_d_head
    conv_dim = intermediate + 2 * config.mamba_n_groups * config.mamba_d_state
    return [(conv_dim, config.mamba_d_conv - 1),
            (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state)]


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.mamba_n_heads, config.mamba_d_head
        self.num_groups, self.state_size = config.mamba_n_groups, config.mamba_d_state
        self.intermediate = self.num_heads * self.head_dim
        self.conv_dim = self.intermediate + 2 * self.num_groups * self.state_size
        self.time_step_limit = config.mamba_time_step_limit
        self.eps = config.rms_norm_eps
        self.in_proj = nn.Linear(config.hidden_size, self.intermediate + self.conv_dim + self.num_heads,
                                 bias=config.mamba_proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, config.mamba_d_conv))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim)) if config.mamba_conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm_weight = nn.Parameter(torch.empty(self.intermediate))
        self.out_proj = nn.Linear(self.intermediate, config.hidden_size, bias=config.mamba_proj_bias)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                query_start_loc: list[int]) -> torch.Tensor:
        """x [T, hidden] of B requests laid end to end (query_start_loc, B + 1 offsets);
        conv_state [B, conv channels, kernel - 1] and ssm_state [B, heads, head_dim, d_state],
        float32, are each request's states before its tokens, updated in place to after them."""
        gate, xbc, dt = self.in_proj(x).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
        decay = dt * -self.A_log.float().exp()  # [T, heads], <= 0
        y = torch.empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        xs = torch.empty_like(y)  # the convolved x, for the D skip
        starts, ends = query_start_loc[:-1], query_start_loc[1:]
        if ends[-1] == len(starts):  # decodes only: one step for the whole batch
            xs[:], b, c = self._split(conv_step(xbc, conv_state, self.conv_weight, self.conv_bias))
            y[:] = _scan_step(xs, dt, decay, b, c, ssm_state)
        else:
            for i, (s, e) in enumerate(zip(starts, ends)):
                if e > s:
                    xs[s:e], b, c = self._split(conv_chunk(xbc[s:e], conv_state[i], self.conv_weight,
                                                           self.conv_bias))
                    y[s:e] = _chunked_scan(xs[s:e], dt[s:e], decay[s:e], b, c, ssm_state[i])
        y += self.D.float()[:, None] * xs
        return self.out_proj(self._gated_norm(y.view(x.shape[0], -1), gate).to(x.dtype))

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, heads, head_dim], and B, C [N, heads, d_state] (each group's, for its heads)."""
        group_size = self.num_groups * self.state_size
        xs, b, c = xbc.split([self.intermediate, group_size, group_size], dim=-1)
        per_group = self.num_heads // self.num_groups
        b, c = (t.reshape(-1, self.num_groups, self.state_size).repeat_interleave(per_group, dim=1)
                for t in (b, c))
        return xs.reshape(-1, self.num_heads, self.head_dim), b, c

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y * silu(gate), RMS-normalized over each group of channels, times the weight."""
        gated = y * F.silu(gate.float())
        grouped = gated.view(y.shape[0], self.num_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * grouped.view_as(y).to(self.norm_weight.dtype)


def _scan_step(x: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token per request: x [B, H, P], dt and decay [B, H], b and c [B, H, N]; state
    [B, H, P, N] updated in place. y [B, H, P] without the D skip."""
    state.mul_(decay.exp()[..., None, None]).add_((dt[..., None] * x)[..., None] * b[:, :, None, :])
    return (state @ c[..., None])[..., 0]


def _chunked_scan(x: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor,
                  c: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One request's L tokens: x [L, H, P], dt and decay [L, H], b and c [L, H, N]; state [H, P, N]
    updated in place. y [L, H, P] without the D skip. Blocks of CHUNK tokens (module docstring)."""
    out = torch.empty_like(x)
    for s in range(0, x.shape[0], CHUNK):
        xc = (dt[s:s + CHUNK, :, None] * x[s:s + CHUNK]).transpose(0, 1)  # [H, C, P]: dt_j x_j
        bc, cc = (t[s:s + CHUNK].transpose(0, 1) for t in (b, c))  # [H, C, N]
        gamma = decay[s:s + CHUNK].t().cumsum(-1)  # [H, C]
        n = gamma.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        pair_decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        scores = (cc @ bc.transpose(1, 2)) * pair_decay  # [H, C, C]
        out[s:s + CHUNK] = (gamma.exp()[..., None] * (cc @ state.transpose(1, 2))
                            + scores @ xc).transpose(0, 1)
        to_end = (gamma[:, -1:] - gamma).exp()[..., None]  # [H, C, 1]
        state.mul_(gamma[:, -1].exp()[:, None, None]).add_((xc * to_end).transpose(1, 2) @ bc)
    return out
