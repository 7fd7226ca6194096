"""``SmolLM3ForCausalLM`` (SmolLM3-3B): Llama's block where every ``no_rope_layer_interval``-th layer
(every fourth) leaves Q and K unrotated (``no_rope_layers[i] == 0``, NoPE), and sliding-window
layers where ``use_sliding_window`` and ``layer_types`` say so."""

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.decoder.variant_attention import VariantAttention, window_of


def uses_rope(config: dict) -> list[bool]:
    """Per layer, whether it rotates: ``no_rope_layers`` (1: rotary), else every
    ``no_rope_layer_interval``-th layer unrotated, as transformers' config derives it."""
    n, every = int(config["num_hidden_layers"]), int(config.get("no_rope_layer_interval") or 4)
    flags = config.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {n} layers")
    return [bool(f) for f in flags]


class SmolLM3ForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = False
    attention_features = frozenset({SLIDING_WINDOW})

    def build_attention(self, layer_id: int):
        c = self.config
        rope = uses_rope(c)[layer_id]
        types = c.get("layer_types") or []
        sliding = bool(c.get("use_sliding_window")) and layer_id < len(types) and types[layer_id] == "sliding_attention"
        window = window_of(c, sliding)
        if rope and window is None:
            return None
        return VariantAttention(
            c,
            layer_id,
            self.head_dim,
            self.tp,
            qkv_bias=bool(c.get("attention_bias", False)),
            rotary_dim=None if rope else 0,
            sliding_window=window,
        )
