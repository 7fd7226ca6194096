"""``MistralForCausalLM`` (Mistral 7B, Mistral Nemo, Mistral Small, Ministral's text models): Llama's
block, with a sliding window over the keys where ``sliding_window`` is set and shorter than the
context (Mistral 7B v0.1's 4096); the later checkpoints have none and run Llama's fast paths.
``Mistral3ForConditionalGeneration`` checkpoints are served as their language model."""

from __future__ import annotations

import logging
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
        window = window_of(self.config)
        if window is None:
            return None
        return VariantAttention(self.config, layer_id, self.head_dim, self.tp, sliding_window=window)


class Mistral3ForConditionalGeneration(MistralForCausalLM):
    """Mistral Small 3.1 / 3.2 (``Mistral3ForConditionalGeneration``) served as its language model
    alone: text in, text out. The Pixtral vision tower and projector in the checkpoint are skipped
    (counted in the log); images are refused as for any text model. Ministral 3's text model
    (``ministral3``, its own attention scaling) is not this one and is refused."""

    def __init__(self, config: dict, tp=None) -> None:
        text = dict(config.get("text_config") or {})
        kind = text.get("model_type", "mistral")
        if kind != "mistral":
            raise ValueError(
                f"text_config.model_type '{kind}' is not supported for Mistral3ForConditionalGeneration; supported: mistral"
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
