"""The short causal depthwise convolution of a hybrid model's state layers (before a Gated
DeltaNet's delta rule, or LFM2's gated short convolution), carrying its last ``K - 1`` inputs as
state between a request's steps (torch reference). ``silu``: whether SiLU follows the convolution
(the DeltaNet's does; LFM2's has none)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, bias=None, silu: bool = True):
    """One sequence: ``x [T, C]``, ``weight [C, K]``, ``state [C, K - 1]`` (the inputs before ``x``;
    None: zeros). Returns ``conv(x) [T, C]`` (after SiLU with ``silu``) and the new state (the
    last ``K - 1`` inputs)."""
    T, C = x.shape
    width = weight.shape[1]
    xt = x.t().to(weight.dtype)
    if state is None:
        state = xt.new_zeros(C, width - 1)
    padded = torch.cat([state.to(weight.dtype), xt], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), bias, groups=C)[0]  # [C, T]
    if silu:
        out = F.silu(out)
    return out.t().to(x.dtype), padded[:, -(width - 1) :]


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias=None, silu: bool = True):
    """One token of each of B sequences: ``x [B, C]``, ``state [B, C, K - 1]``. Returns
    ``conv [B, C]`` (after SiLU with ``silu``) and the new states."""
    window = torch.cat([state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window * weight).sum(-1)
    if bias is not None:
        out = out + bias
    if silu:
        out = F.silu(out)
    return out.to(x.dtype), window[..., 1:]
