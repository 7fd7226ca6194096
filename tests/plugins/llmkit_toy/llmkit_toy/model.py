"""A model architecture from a third party: Llama's layers under another name."""

from llmkit.plugins.models.llama import LlamaForCausalLM


class ToyLlamaForCausalLM(LlamaForCausalLM):
    pass
