"""LongRoPE (Phi-3 / Phi-4's ``rope_type: longrope``): the rotary frequencies divided per channel by
``short_factor`` within the pretraining length (``original_max_position_embeddings``) and by
``long_factor`` past it, cos and sin scaled by ``sqrt(1 + ln(factor) / ln(original))``.

transformers picks one set for the whole sequence (the long one once a sequence outgrows the
original length, recomputing the earlier positions too); a paged cache keeps the keys it wrote, so
here a position's row follows its own index, as vLLM does: identical below the original length.
"""

from __future__ import annotations

import math

import torch

from llmkit.core.model.layers import RotaryEmbedding, _rope_params


class LongRopeEmbedding(RotaryEmbedding):
    def __init__(self, rotary_dim: int, max_positions: int, config: dict) -> None:
        torch.nn.Module.__init__(self)
        params = _rope_params(config)
        theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        original = int(params.get("original_max_position_embeddings") or config["original_max_position_embeddings"])
        factor = params.get("factor") or float(config["max_position_embeddings"]) / original
        scale = params.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        rows = []
        for key, lo, hi in (
            ("short_factor", 0, min(original, max_positions)),
            ("long_factor", original, max_positions),
        ):
            if hi <= lo:
                continue
            ext = torch.tensor(params[key], dtype=torch.float32)
            if ext.numel() != rotary_dim // 2:
                raise ValueError(f"rope {key} has {ext.numel()} entries; the rotary dims want {rotary_dim // 2}")
            inv = 1.0 / (ext * theta**shape)  # in fp32, as transformers computes it
            rows.append(torch.outer(torch.arange(lo, hi, dtype=torch.float32), inv))
        freqs = torch.cat(rows)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.register_buffer("cos2", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin2", torch.cat((-sin, sin), dim=-1), persistent=False)
        self._cast = {}
