"""``Qwen2_5_VLForConditionalGeneration``: Qwen2.5-VL, images in, text out.

The language model is the Qwen2 decoder (Q/K/V biases) rotating by M-RoPE: every rotary frequency
band reads one of three position axes (``mrope_section`` splits the bands into temporal, height
and width), so an image's tokens sit on a 2-D grid while text tokens, whose three axes are equal,
rotate exactly as with plain rope. The engine hands the per-row (t, h, w) positions and the image
rows in ``ctx.mm``; the rope table built from them has the layout of the plain one, so the fused
and native CPU paths run unchanged.

The vision tower is Qwen2.5-VL's ViT: 14x14 (x2 frames) patches, 2-D rotary over (row, column),
blocks attending within windows of merged cells except the ``fullatt_block_indexes`` ones that
attend over the whole image, RMSNorm and a SwiGLU MLP, then a merger folding each 2x2 block of
patches into one language-model token. The processor's patch order already groups each 2x2 block
together; each attention gathers its frames or windows, batched by size (no reordering).

``QwenVLMixin`` (the image rows, the M-RoPE table, ``encode_images``, both checkpoint layouts),
``QwenVLProcessor`` and the tower live in ``core/model/qwen_vl/``: Qwen3-VL and Qwen3.5 share them.
"""

from __future__ import annotations

from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.qwen_vl.mixin import QwenVLMixin
from llmkit.core.model.qwen_vl.processor import QwenVLProcessor
from llmkit.core.model.qwen_vl.qwen2_5_tower import Qwen2_5_VisionTower


class Qwen2_5_VLForConditionalGeneration(QwenVLMixin, DecoderLM):
    """On Qwen2's decoder (biases on Q/K/V)."""

    vision_tower = Qwen2_5_VisionTower
    qkv_bias = True
    qk_norm = False


Qwen2_5_VLProcessor = QwenVLProcessor
