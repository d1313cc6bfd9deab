"""The short causal depthwise convolution a recurrent layer runs over its projected inputs (Gated
DeltaNet, Mamba2), with the last kernel - 1 inputs of each request kept as its conv state, so a
request's tokens convolve the same in one prefill, in chunks, or one decode at a time. Float32;
SiLU after."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_chunk(rows: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """One request's L new rows [L, channels] after its saved inputs; conv_state
    [channels, kernel - 1] becomes the last kernel - 1 inputs. weight [channels, kernel]."""
    history = torch.cat([conv_state, rows.float().t()], dim=1)  # [channels, kernel - 1 + L]
    out = F.conv1d(history[None], weight.float()[:, None], None if bias is None else bias.float(),
                   groups=weight.shape[0])[0]
    conv_state.copy_(history[:, history.shape[1] - conv_state.shape[1]:])
    return F.silu(out.t())


def conv_step(rows: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """One new row per request [B, channels]; conv_state [B, channels, kernel - 1]."""
    window = torch.cat([conv_state, rows.float()[:, :, None]], dim=2)  # [B, channels, kernel]
    conv_state.copy_(window[:, :, 1:])
    out = (window * weight.float()).sum(-1)
    return F.silu(out if bias is None else out + bias.float())
