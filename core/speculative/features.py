"""The target model's hidden states that a draft head reads (EAGLE-3's "features").

A proposer that wants them names layer indices: the residual stream at the input of each (index
``num_layers``: after the last layer, before the final norm), as SGLang and vLLM capture them. The
model runner passes a :class:`FeatureCapture` in the forward context; the model copies each named
layer input into it, and the runner hands every segment's rows to the proposer's ``observe``.
"""

from __future__ import annotations

import torch


class FeatureCapture:
    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(sorted(layers))
        self._wanted = set(self.layers)
        self._states: list[torch.Tensor] = []

    def take(self, index: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """The input of layer ``index``: ``x`` plus the residual the layer's norm adds to it."""
        if index in self._wanted:
            self._states.append(x if residual is None else x + residual)

    def features(self) -> torch.Tensor | None:
        """``[rows, len(layers) * hidden]``, in layer order (one row per forward row); None when the
        forward took a path that captures nothing (Qwen3-VL's image rows: no drafts for them)."""
        if len(self._states) != len(self.layers):
            return None
        return torch.cat(self._states, dim=-1)
