"""Small pieces both Qwen vision towers use: the activation by name, rotate-half with a 2-D
rotary table, and attention groups by image or window."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    return F.gelu


def segment_groups(segment: torch.Tensor) -> list[torch.Tensor]:
    """Patches grouped by ``segment`` (their frame's or window's number): per distinct segment
    size s, the ``[B, s]`` indices of the B segments that size, so each attends in one batch."""
    order = torch.argsort(segment, stable=True)
    _, counts = torch.unique_consecutive(segment[order], return_counts=True)
    starts = counts.cumsum(0) - counts
    groups = []
    for size in counts.unique().tolist():
        first = starts[counts == size]
        groups.append(order[first[:, None] + torch.arange(size, device=segment.device)])
    return groups


def rotate_half(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half rotary in fp32 with a full-width ``(cos2, sin2 = [-sin, sin])`` table."""
    cos2, sin2 = rope
    xf = x.float()
    return (xf * cos2 + xf.roll(x.shape[-1] // 2, -1) * sin2).to(x.dtype)
