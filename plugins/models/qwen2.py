"""``Qwen2ForCausalLM`` (Qwen2 / Qwen2.5): a Llama-style decoder with biases on Q/K/V."""

from llmkit.plugins.models.decoder import DecoderLM


class Qwen2ForCausalLM(DecoderLM):
    qkv_bias = True
    qk_norm = False
