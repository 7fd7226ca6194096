"""Attention backends. Registration names classes lazily, so listing plugins never imports torch."""

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_attention_backends(register):
    register("torch", "llmkit.plugins.attention.torch_backend:TorchAttentionBackend")
    register("triton", "llmkit.plugins.attention.triton_backend:TritonAttentionBackend")
    register("flashinfer", "llmkit.plugins.attention.flashinfer_backend:FlashInferAttentionBackend")
