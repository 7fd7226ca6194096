"""``QwenVLMixin``: what the Qwen vision-language models add to their text decoder."""

from __future__ import annotations

from typing import Iterable

import torch

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.parallel import TPGroup
from llmkit.core.model.qwen_vl.config import mrope_axis, mrope_section, text_config
from llmkit.core.model.qwen_vl.processor import QwenVLProcessor
from llmkit.core.multimodal.items import ImageItem
from llmkit.core.multimodal.model import VisionLanguageModel


class QwenVLMixin(VisionLanguageModel):
    """What the Qwen vision-language models add to their text decoder: the image rows in the
    input embeddings, the M-RoPE table, the vision tower (``vision_tower``, built from
    ``vision_config``) and both checkpoint layouts. Listed before the decoder class."""

    vision_tower: type
    mrope_interleaved = False
    supports_tp = False  # the vision tower is not sharded (the decoder would be)

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        config = text_config(config)
        super().__init__(config, tp)
        self.visual = self.vision_tower(config["vision_config"])
        # the sections cover the rotated width: Qwen3.5 rotates only the first part of each head
        axis = mrope_axis(mrope_section(config), self.rotary.cos2.shape[-1], self.mrope_interleaved)
        self.register_buffer("mrope_axis", axis, persistent=False)

    # --- language model -----------------------------------------------------------------------

    def embed(self, input_ids, ctx: ForwardContext):
        mm = ctx.mm
        if mm is None:
            return self.embed_tokens(input_ids)
        x = self.embed_tokens(input_ids.masked_fill(mm.mask, 0))  # pseudo-ids: never looked up
        if mm.embeds.shape[0]:
            x[mm.mask] = mm.embeds[:, : x.shape[1]].to(x.dtype)  # (wider rows: Qwen3-VL's deepstack)
        return x

    def rope_table(self, positions, ctx: ForwardContext, dtype):
        mm = ctx.mm
        if mm is None or mm.rope_positions is None:
            return self.rotary.table(positions, dtype)
        pos = mm.rope_positions.to(positions.device)  # [3, T]
        n, width = pos.shape[1], self.mrope_axis.shape[0]
        pick = self.mrope_axis.view(1, 1, width).expand(1, n, width)
        cos = self.rotary.cos2[pos].gather(0, pick)[0]
        sin = self.rotary.sin2[pos].gather(0, pick)[0]
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    # --- images -------------------------------------------------------------------------------

    @classmethod
    def processor(cls, model_dir: str, config: dict, tokenizer=None) -> "QwenVLProcessor":
        from transformers import AutoImageProcessor

        return QwenVLProcessor(AutoImageProcessor.from_pretrained(str(model_dir)), config, tokenizer)

    def encode_images(self, items: list[ImageItem]) -> list[torch.Tensor]:
        if not items:
            return []
        grids = [tuple(int(v) for v in item.meta["grid_thw"]) for item in items]
        pixels = torch.cat([item.pixel_values for item in items])
        with torch.inference_mode():
            rows = self.visual(pixels, grids).to(self.embed_tokens.weight.dtype)
        return list(rows.split([item.num_tokens for item in items]))

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision_params = {name for name, _ in self.visual.named_parameters()}
        seen: set[str] = set()

        def renamed():
            for name, tensor in weights:
                # transformers 5 in memory: model.language_model.* / model.visual.*; on disk (and
                # transformers 4): model.layers.* / visual.*
                if name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                elif name.startswith("model.visual."):
                    name = name.removeprefix("model.")
                if name.startswith("visual."):
                    seen.add(name.removeprefix("visual."))
                    name = "model." + name  # DecoderLM strips "model."
                yield name, tensor

        super().load_weights(renamed())
        missing = sorted(vision_params - seen)
        if missing:
            raise KeyError(f"checkpoint is missing vision weights: {missing[:5]}")
