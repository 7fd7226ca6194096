"""The model-architecture contract that model plugins implement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from llmkit.core.model.attention import AttentionBackend, AttentionMetadata
from llmkit.core.model.parallel import SINGLE, TPGroup


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

    ``config`` is the model's HF ``config.json`` as a dict. ``tp`` is this process's place in a
    tensor-parallel group; a plugin that shards its layers over it sets ``supports_tp``.
    """

    #: whether the plugin shards its layers over ``tp`` (``--tp-size`` > 1 is refused otherwise)
    supports_tp: bool = False
    #: whether the plugin reads its checkpoint's ``quantization_config`` itself (else only the
    #: GPTQ/AWQ formats the core loads are accepted)
    reads_own_quantization: bool = False
    #: whether a decode step may be captured in a CUDA graph (False: a step reads data-dependent
    #: sizes back to the host, as the torch MoE path's per-expert grouping does)
    supports_cuda_graph: bool = True
    #: attention features (``llmkit.core.model.attention.ATTENTION_FEATURES``) the layers pass to
    #: the backend; a backend without one of them is refused at start-up
    attention_features: frozenset[str] = frozenset()

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or SINGLE

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Return final hidden states ``[T, hidden]`` for the batch's T new tokens."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Project hidden states ``[N, hidden]`` to fp32 logits ``[N, vocab]``."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the module's parameters."""

    # The walks over the layers live in quantize.py (they know the layer types and the format
    # table); these methods stay so the engine calls them on any model and a plugin can extend them.
    def finalize_weights(self) -> None:
        """Let every linear layer pack its weight once loading is done."""
        from llmkit.core.model import quantize

        quantize.finalize_weights(self)

    def quantize(self, method: str, group_size: int | None = None) -> None:
        """Convert the dense weights of every linear layer, the LM head and the MoE experts to the
        weight format ``method`` names (``--quantization``); experts already quantized (at load,
        see :meth:`quantize_experts`) stay as they are."""
        from llmkit.core.model import quantize

        quantize.quantize(self, int(self.config["hidden_size"]), method, group_size)

    def quantize_experts(self, method: str, group_size: int | None = None) -> None:
        """Before loading: give the MoE experts ``--quantization``'s format, so each expert is
        quantized as its tensors arrive and the experts' fp32 weights (most of an MoE model) are
        never resident at once. The other layers are converted after loading (:meth:`quantize`)."""
        from llmkit.core.model import quantize

        quantize.quantize_experts(self, method, group_size)

    def weight_bytes(self) -> int:
        """Bytes the loaded weights hold, quantized buffers included; each storage counted once."""
        from llmkit.core.model import quantize

        return quantize.weight_bytes(self)

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.config["num_attention_heads"])

    @property
    def local_heads(self) -> int:
        """Query heads this rank computes (all of them without tensor parallelism)."""
        return int(self.config["num_attention_heads"])

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank caches."""
        return self.num_kv_heads

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """Per KV head and token, the channels the pool stores for keys and for values (0: the
        values are a prefix of the keys, see ``latent_kv`` in ``llmkit.core.model.attention``)."""
        return self.head_dim, self.head_dim

    @property
    def attention_v_dim(self) -> int:
        """The head size of the attention output (the values')."""
        k, v = self.kv_cache_dims
        return v or k

    @property
    def attention_scale(self) -> float | None:
        """The softmax scale (None: ``head_dim ** -0.5``)."""
        return None

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
