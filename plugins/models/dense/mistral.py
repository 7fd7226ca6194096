"""``MistralForCausalLM`` (Mistral 7B, Mistral Nemo, Mistral Small, Ministral's text models): Llama's
block, with a sliding window over the keys where ``sliding_window`` is set and shorter than the
context (Mistral 7B v0.1's 4096); the later checkpoints have none and run Llama's fast paths.
Ministral 3 (``Ministral3ForCausalLM``, ``ministral3``) adds Llama 4's query temperature: past
``original_max_position_embeddings`` a row's rotated queries are scaled by
``1 + llama_4_scaling_beta * log(1 + floor(p / original))``.
``Mistral3ForConditionalGeneration`` checkpoints are served as their language model."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Iterable

import torch

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.decoder.variant_attention import VariantAttention, window_of

log = logging.getLogger(__name__)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class MistralForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = False
    # declared for every checkpoint (the class decides the backend before the config is read)
    attention_features = frozenset({SLIDING_WINDOW})

    def build_attention(self, layer_id: int):
        window, scale = window_of(self.config), query_scale_of(self.config)
        if window is None and scale is None:
            return None
        return VariantAttention(self.config, layer_id, self.head_dim, self.tp, sliding_window=window, query_scale=scale)

    def forward(self, input_ids, positions, ctx):
        if self.layers and getattr(self.layers[0].self_attn, "query_scale", None) is not None:
            ctx = replace(ctx, positions=positions)  # the layers scale their queries by position
        return super().forward(input_ids, positions, ctx)


class Ministral3ForCausalLM(MistralForCausalLM):
    """Ministral 3's text model: Mistral's with position-scaled queries (``query_scale_of``)."""


def query_scale_of(config: dict):
    """Ministral 3's factor per row, from ``rope_parameters`` (None where the config has none)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return None
    beta, original = float(beta), float(params["original_max_position_embeddings"])

    def scale(positions: torch.Tensor) -> torch.Tensor:
        return 1 + beta * torch.log1p(torch.floor(positions.float() / original))

    return scale


class Mistral3ForConditionalGeneration(MistralForCausalLM):
    """Mistral Small 3.1 / 3.2 (``Mistral3ForConditionalGeneration``) served as its language model
    alone: text in, text out. The Pixtral vision tower and projector in the checkpoint are skipped
    (counted in the log); images are refused as for any text model. Ministral 3's checkpoints
    (text model ``ministral3``) likewise, with their position-scaled queries."""

    def __init__(self, config: dict, tp=None) -> None:
        text = dict(config.get("text_config") or {})
        kind = text.get("model_type", "mistral")
        if kind not in ("mistral", "ministral3"):
            raise ValueError(
                f"text_config.model_type '{kind}' is not supported for Mistral3ForConditionalGeneration; "
                "supported: mistral, ministral3"
            )
        # the composite config decides tying (the text config keeps its own default)
        text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        super().__init__(text, tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skipped = 0

        def text_only(stream):
            nonlocal skipped
            for name, tensor in stream:
                if name.startswith(VISION_PREFIXES):
                    skipped += 1
                    continue
                # checkpoints: language_model.model.* / language_model.lm_head; transformers 5: model.language_model.*
                name = name.replace("language_model.model.", "model.").replace("model.language_model.", "model.")
                yield name.removeprefix("language_model."), tensor

        super().load_weights(text_only(weights))
        log.info("Mistral3ForConditionalGeneration: serving the language model; %d vision tensors skipped", skipped)
