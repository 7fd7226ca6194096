"""The model-architecture contract that model plugins implement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.attention import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """What every layer needs for one forward pass, passed explicitly (no globals)."""

    attn: AttentionBackend
    metadata: AttentionMetadata

    @property
    def deterministic(self) -> bool:
        return self.metadata.deterministic


class CausalLM(nn.Module, ABC):
    """A decoder-only LM whose attention layers go through an :class:`AttentionBackend`.

    ``config`` is the model's HF ``config.json`` as a dict.
    """

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Return final hidden states ``[T, hidden]`` for the batch's T new tokens."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Project hidden states ``[N, hidden]`` to fp32 logits ``[N, vocab]``."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the module's parameters."""

    def quantize(self, method: str) -> None:
        """Add quantized weight copies (``"int8"``: weight-only, per channel) to every layer that
        supports it; plugins with other layers override this."""
        if method != "int8":
            raise ValueError(f"quantization '{method}' is not supported; supported: int8")
        for module in self.modules():
            if module is not self and hasattr(module, "quantize_int8"):
                module.quantize_int8()

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.config["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
