"""``Qwen3VLForConditionalGeneration``: Qwen3-VL (dense), images in, text out.

Against Qwen2.5-VL (whose image rows, M-RoPE table, processor and checkpoint layouts it shares,
from ``core/model/qwen_vl/``): the decoder is Qwen3's (per-head Q/K RMSNorm, no biases), M-RoPE interleaves
its axes over the frequencies, and the vision tower differs: 16x16 patches with a learned position
table resampled bilinearly to each image's grid, LayerNorm blocks with a GELU MLP attending over
the whole image, and DeepStack: blocks ``deepstack_visual_indexes`` each feed a merger of their own
whose rows are added to the hidden states of image tokens after decoder layer 0, 1, ...

``encode_images`` therefore returns rows ``(1 + len(deepstack_visual_indexes)) * hidden`` wide:
the input embedding, then each DeepStack level. The engine slices them by row like any encoder
output; the forward reads the levels from ``ctx.mm.embeds``. A forward with image rows runs the
Python layers (the additions sit between layers); the rest keep the native stack.
"""

from __future__ import annotations

from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.qwen_vl.mixin import QwenVLMixin
from llmkit.core.model.qwen_vl.qwen3_tower import Qwen3VisionTower


class Qwen3VLForConditionalGeneration(QwenVLMixin, DecoderLM):
    """On Qwen3's decoder (per-head Q/K RMSNorm, no biases)."""

    qkv_bias = False
    qk_norm = True
    vision_tower = Qwen3VisionTower
    mrope_interleaved = True

    @property
    def deepstack_levels(self) -> int:
        return len(self.visual.deepstack_indexes)

    def forward(self, input_ids, positions, ctx):
        mm, levels = ctx.mm, self.deepstack_levels
        if mm is None or not levels or mm.embeds.shape[0] == 0:
            return super().forward(input_ids, positions, ctx)
        x, residual = self.embed(input_ids, ctx), None
        rope = self.rope_table(positions, ctx, x.dtype)
        hidden = x.shape[1]
        deep = mm.embeds[:, hidden:].reshape(-1, levels, hidden).to(x.dtype)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, ctx)
            if i < levels:  # the layer's output is x + residual: add to the image rows' x
                x[mm.mask] += deep[:, i]
        x, _ = self.norm(x, residual)
        return x
