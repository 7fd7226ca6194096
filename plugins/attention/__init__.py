"""Attention backends. Registration names classes lazily, so listing plugins never imports torch."""

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_attention_backends(register):
    # ``auto``: rank for --attention auto per device type (highest first). triton leads on CUDA
    # because its decode steps replay CUDA graphs; the flashinfer plugin runs eagerly.
    register("torch", "llmkit.plugins.attention.torch_backend:TorchAttentionBackend", auto={"cpu": 10, "cuda": 0})
    register("triton", "llmkit.plugins.attention.triton_backend:TritonAttentionBackend", auto={"cuda": 20})
    register("flashinfer", "llmkit.plugins.attention.flashinfer_backend:FlashInferAttentionBackend", auto={"cuda": 10})
