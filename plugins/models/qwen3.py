"""``Qwen3ForCausalLM``: no Q/K/V bias, RMSNorm on each head's Q and K before rotary."""

from llmkit.core.model.decoder.stack import DecoderLM


class Qwen3ForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = True
