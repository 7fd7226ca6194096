"""Recognise an embedding model from its config and start an :class:`EmbeddingEngine` for it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from llmkit.core.embedding.engine import EmbeddingEngine
from llmkit.core.embedding.pooling import matryoshka_dimensions, max_input_tokens, read_pooling
from llmkit.core.plugins import registry

log = logging.getLogger("llmkit")


def encoder_architecture(config: dict) -> str | None:
    """The model plugin name when ``config`` (config.json) names an encoder one registered with
    ``embedding=True``; None for anything else (a causal LM, or an architecture no plugin knows)."""
    reg = registry()
    archs = config.get("architectures") or []
    name = archs[0] if archs else reg.architecture_for_model_type(config.get("model_type", ""))
    if name is None or name not in reg.names("model"):
        return None
    return name if reg.entry("model", name).meta.get("embedding") else None


def start_embedding_engine(model_dir: Path, config: dict, *, device: str = "auto", dtype: str = "auto"):
    """Load the encoder named by ``config`` and start its worker thread."""
    arch = encoder_architecture(config)
    if arch is None:
        names = [n for n in registry().names("model") if registry().entry("model", n).meta.get("embedding")]
        found = (config.get("architectures") or [config.get("model_type", "?")])[0]
        raise ValueError(f"'{found}' is not an embedding architecture; supported: {', '.join(names)}")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    # fp32 on CPU, where bf16 math is slow; bf16 on CUDA, as the generation engine's default
    dt = {"auto": torch.float32 if dev.type == "cpu" else torch.bfloat16}.get(dtype) or getattr(torch, dtype)
    encoder = registry().model(arch).from_pretrained(model_dir, config, dev, dt)
    pooling = read_pooling(model_dir)
    limit = max_input_tokens(model_dir, encoder.max_position)
    log.info(
        "Embedding model %s on %s (%s): %s pooling%s, inputs up to %d tokens",
        arch,
        dev,
        dt,
        pooling.mode,
        ", normalised" if pooling.normalize else "",
        limit,
    )
    return EmbeddingEngine(
        encoder, pooling, device=dev.type, max_input_tokens=limit, dimensions=matryoshka_dimensions(config)
    )
