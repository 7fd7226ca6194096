"""Qwen3.5 / Qwen3.6: ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM`` and the language models of
their image-text checkpoints (``...ForConditionalGeneration``), a hybrid stack of three Gated
DeltaNet layers to each gated full-attention one (``core/model/decoder/hybrid_stack.py``)."""

from __future__ import annotations

from llmkit.core.model.decoder.hybrid_stack import HybridLM


class Qwen3_5ForCausalLM(HybridLM):
    pass


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The image-text checkpoint's language model (its vision tower is not served yet: images are
    refused as on any text model)."""


class Qwen3_5MoeForCausalLM(HybridLM):
    """Every layer's feed-forward a routed MoE with a gated shared expert."""

    sparse_mlp = True
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The image-text MoE checkpoint's language model (no vision tower yet)."""
