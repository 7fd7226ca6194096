"""``Qwen2ForCausalLM`` (Qwen2 / Qwen2.5): a Llama-style decoder with biases on Q/K/V."""

from llmkit.core.model.decoder.stack import DecoderLM


class Qwen2ForCausalLM(DecoderLM):
    qkv_bias = True
    qk_norm = False
