"""What one forward hands a vision-language model about the images among its rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MultimodalForward:
    """``ForwardContext.mm``: set when some rows of the forward are image tokens or need M-RoPE."""

    # [T] bool: rows whose input embedding is the next row of ``embeds`` (their ids are pseudo-ids,
    # which the model must not look up in its embedding table)
    mask: torch.Tensor
    embeds: torch.Tensor  # [mask.sum(), hidden]: the encoder's rows for them, in row order
    # [3, T] int64 (t, h, w) rotary positions of every row (M-RoPE models), None: ``positions``
    rope_positions: torch.Tensor | None = None
