"""Registers the GPU attention backends (``triton``, ``flashinfer``) lazily.

Only ``"module:Class"`` strings are registered, so importing this module (as ``llmkit plugins``
and start-up do) imports neither torch, triton nor flashinfer; a backend's module is imported
only when that backend is chosen.
"""

from __future__ import annotations

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_attention_backends(register):
    register("triton", "llmkit.plugins.attention.triton_backend:TritonAttentionBackend")
    register("flashinfer", "llmkit.plugins.attention.flashinfer_backend:FlashInferAttentionBackend")
