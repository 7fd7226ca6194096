"""The short causal depthwise convolution before a linear-attention or Mamba layer, carrying its
last ``K - 1`` inputs as state between a request's steps (torch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, bias=None):
    """One sequence: ``x [T, C]``, ``weight [C, K]``, ``state [C, K - 1]`` (the inputs before ``x``;
    None: zeros). Returns ``silu(conv(x)) [T, C]`` and the new state (the last ``K - 1`` inputs)."""
    T, C = x.shape
    width = weight.shape[1]
    xt = x.t().to(weight.dtype)
    if state is None:
        state = xt.new_zeros(C, width - 1)
    padded = torch.cat([state.to(weight.dtype), xt], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), bias, groups=C)[0]  # [C, T]
    return F.silu(out).t().to(x.dtype), padded[:, -(width - 1) :]


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias=None):
    """One token of each of B sequences: ``x [B, C]``, ``state [B, C, K - 1]``. Returns
    ``silu(conv) [B, C]`` and the new states."""
    window = torch.cat([state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype), window[..., 1:]
