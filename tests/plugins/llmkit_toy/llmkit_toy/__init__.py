"""A third-party plugin: registers the ``toy`` attention backend and ``ToyLlamaForCausalLM``."""

from llmkit.core import hookimpl


@hookimpl
def llmkit_register_attention_backends(register):
    register("toy", "llmkit_toy.attention:ToyAttention")


@hookimpl
def llmkit_register_models(register):
    register("ToyLlamaForCausalLM", "llmkit_toy.model:ToyLlamaForCausalLM")
