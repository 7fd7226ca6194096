"""``LlamaForCausalLM`` (Llama 2/3, SmolLM2, Mistral-style dense models)."""

from llmkit.core.model.decoder.stack import DecoderLM


class LlamaForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = False
