"""A model architecture from a third party: Llama's layers under another name, built as a plugin
builds one, on the decoder stack core shares (never on another plugin's module)."""

from llmkit.core.model.decoder.stack import DecoderLM


class ToyLlamaForCausalLM(DecoderLM):
    qkv_bias = False
    qk_norm = False
