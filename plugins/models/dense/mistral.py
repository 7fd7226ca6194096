"""``MistralForCausalLM`` (Mistral 7B, Mistral Nemo, Mistral Small, Ministral's text models): Llama's
block, with a sliding window over the keys where ``sliding_window`` is set and shorter than the
context (Mistral 7B v0.1's 4096); the later checkpoints have none and run Llama's fast paths."""

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.decoder.stack import DecoderLM
from llmkit.core.model.decoder.variant_attention import VariantAttention, window_of


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
