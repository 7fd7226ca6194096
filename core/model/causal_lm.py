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
    # Set when some rows of this forward use a LoRA adapter (``llmkit.core.lora``): the adapted
    # projections read their row groups from it (the C decoder stack runs them itself).
    lora: object | None = None
    # Set when some rows are image tokens or rotate by M-RoPE (``llmkit.core.multimodal.forward``).
    mm: object | None = None
    # Set when a speculative proposer reads the target's hidden states (EAGLE-3): a
    # :class:`~llmkit.core.speculative.features.FeatureCapture` the layers' inputs are copied to.
    capture: object | None = None
    # Set for a hybrid model: the state slots each sequence's state layers read and write
    # (a :class:`~llmkit.core.kvcache.state_pool.StateBatch`).
    states: object | None = None
    # Set when window layers keep only their window (``llmkit.core.kvcache.window_pages``): their
    # metadata (the window pool's slot table and slots) and the K/V layers it serves.
    window_metadata: AttentionMetadata | None = None
    window_layers: frozenset[int] = frozenset()
    # Set by a model whose layers read each row's position beyond the rope table (Ministral 3's
    # position-scaled queries): the forward's ``positions``.
    positions: torch.Tensor | None = None

    @property
    def deterministic(self) -> bool:
        return self.metadata.deterministic

    def kv_metadata(self, kv_layer: int) -> AttentionMetadata:
        """The metadata K/V layer ``kv_layer`` attends with: its window pool's where its window
        pages are kept apart, the forward's otherwise."""
        if kv_layer in self.window_layers:
            return self.window_metadata
        return self.metadata


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
    #: whether its forward fills ``ctx.capture`` (the hidden states EAGLE-3's draft head reads)
    supports_feature_capture: bool = False
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

    def weights_changed(self) -> None:
        """Hook, called after loading (once every linear layer has packed its weight) and again
        after ``--quantization`` converted them: a model derives here what it computes from its
        weights, or drops what it derived. The walks over the layers themselves live in
        ``quantize.py``, which the engine calls; the contract imports nothing below it."""

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def num_kv_layers(self) -> int:
        """Layers with K/V in the paged pool (a hybrid model's attention layers; every layer else)."""
        return self.num_layers

    @property
    def kv_windows(self) -> list[int | None]:
        """Per K/V layer, the sliding window its queries see (a query at position p reads keys at
        positions ``> p - window``), None for full attention (the default: every layer). Window
        layers keep only the pages their window can still reach (``core/kvcache/window_pages.py``)."""
        return [None] * self.num_kv_layers

    def state_specs(self, dtype: torch.dtype) -> list | None:
        """A hybrid model's state layers: per layer, the ``(shape, dtype)`` of each tensor a sequence
        keeps there (``core/kvcache/state_pool.py``), in the order the layers index them; None
        (the default): no state layers."""
        return None

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
    def kv_layer_shapes(self) -> list[tuple[int, int, int]]:
        """Per K/V layer, in the pool's order: this rank's K/V heads and the channels each stores per
        head and token for keys and for values (see :attr:`kv_cache_dims`). The default: every
        layer alike. A model whose layers differ (Gemma 4's full-attention layers: wider heads,
        fewer of them) lists each; the pool sizes each layer's buffers from it, the memory planner
        counts its bytes, and the engine gives each distinct shape its own backend instance."""
        k, v = self.kv_cache_dims
        return [(self.local_kv_heads, k, v)] * self.num_kv_layers

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
