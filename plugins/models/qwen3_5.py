"""Qwen3.5 / Qwen3.6: ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM``, a hybrid stack of three
Gated DeltaNet layers to each gated full-attention one (``core/model/decoder/hybrid_stack.py``), and
their image-text checkpoints (``...ForConditionalGeneration``): images in, text out.

Images take Qwen3-VL's path (the image rows, processor and checkpoint layouts in ``core/model/qwen_vl/``): the
vision tower is Qwen3-VL's without DeepStack (``Qwen3VisionTower`` with no
``deepstack_visual_indexes``), and the gated attention layers rotate by interleaved M-RoPE over the
rotated part of each head (a quarter of head_dim, 64 of 256 channels: ``mrope_section`` covers its
32 frequencies). DeltaNet layers take no positions; image tokens attend causally, so a prefill chunk
may end inside an image. Under tensor parallelism the language model is served alone (``text_model``).
"""

from __future__ import annotations

from llmkit.core.model.decoder.hybrid_stack import HybridLM
from llmkit.core.model.qwen_vl.mixin import QwenVLMixin
from llmkit.core.model.qwen_vl.qwen3_tower import Qwen3VisionTower


class Qwen3_5ForCausalLM(HybridLM):
    pass


class Qwen3_5MoeForCausalLM(HybridLM):
    """Every layer's feed-forward a routed MoE with a gated shared expert."""

    sparse_mlp = True
    supports_cuda_graph = False  # FusedExperts groups tokens by expert with host-side counts


class _Qwen3_5Vision(QwenVLMixin):
    """The vision tower and interleaved M-RoPE on either decoder (listed before it)."""

    vision_tower = Qwen3VisionTower
    mrope_interleaved = True
    skipped = ("mtp.",)  # the vision tower is loaded here; the multi-token-prediction head is not used


class Qwen3_5ForConditionalGeneration(_Qwen3_5Vision, Qwen3_5ForCausalLM):
    text_model = Qwen3_5ForCausalLM  # under --tp-size N: the tower is not sharded, images refused


class Qwen3_5MoeForConditionalGeneration(_Qwen3_5Vision, Qwen3_5MoeForCausalLM):
    text_model = Qwen3_5MoeForCausalLM
