"""Recognise an embedding or reranking model from its config and start an :class:`EmbeddingEngine`
for it: an encoder plugin (``BertModel``; ``*ForSequenceClassification`` cross-encoders score), or
a causal LM forced by ``--is-embedding`` (last-token vectors) or ``--is-reranker`` (yes/no)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from llmkit.core.embedding.decoder import (
    DEFAULT_INSTRUCTION,
    QWEN3_RERANKER_TEMPLATE,
    DecoderEncoder,
    DecoderReranker,
    causal_architecture,
)
from llmkit.core.embedding.engine import EmbeddingEngine
from llmkit.core.embedding.pooling import (
    Pooling,
    matryoshka_dimensions,
    max_input_tokens,
    override_pooling,
    read_pooling,
)
from llmkit.core.model.encoder import Scorer
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


def start_embedding_engine(
    model_dir: Path,
    config: dict,
    *,
    device: str = "auto",
    dtype: str = "auto",
    reranker: bool = False,
    pooler_config: str | None = None,
    instruction: str | None = None,
) -> EmbeddingEngine:
    """Load the model ``config`` names and start its worker thread: an encoder plugin as it is,
    a causal LM as a last-token embedder, or with ``reranker`` as a yes/no reranker (its prompt
    carrying ``instruction``, else the model card's). ``pooler_config``: ``--pooler-config``."""
    if pooler_config and reranker:
        raise ValueError("--pooler-config sets an embedding model's pooling; a reranker does not pool")
    if instruction and not reranker:
        raise ValueError("--rerank-instruction is for a causal LM served with --is-reranker")
    arch = encoder_architecture(config)
    if arch is None and causal_architecture(config) is None:
        names = [n for n in registry().names("model") if registry().entry("model", n).meta.get("embedding")]
        found = (config.get("architectures") or [config.get("model_type", "?")])[0]
        raise ValueError(f"'{found}' is not an embedding architecture; supported: {', '.join(names)} or a causal LM")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    # fp32 on CPU, where bf16 math is slow; bf16 on CUDA, as the generation engine's default
    dt = {"auto": torch.float32 if dev.type == "cpu" else torch.bfloat16}.get(dtype) or getattr(torch, dtype)
    if arch is not None and instruction:
        raise ValueError(f"--rerank-instruction: {arch} reads pairs without a prompt to put it in")

    def build():  # on the engine's worker thread (see EmbeddingEngine.build_and_start)
        return _load(model_dir, config, arch, dev, dt, reranker, pooler_config, instruction)

    return EmbeddingEngine.build_and_start(build)


def _load(model_dir: Path, config: dict, arch, dev, dt, reranker: bool, pooler_config, instruction):
    """The model, its pooling and the engine's other arguments."""
    template = None
    if arch is not None:
        model = registry().model(arch).from_pretrained(model_dir, config, dev, dt)
    elif reranker:
        arch = causal_architecture(config) + " (yes/no reranker)"
        model = DecoderReranker.from_pretrained(model_dir, config, dev, dt)
        template = QWEN3_RERANKER_TEMPLATE.replace("{instruction}", instruction or DEFAULT_INSTRUCTION)
    else:
        arch = causal_architecture(config) + " (last-token embedder)"
        model = DecoderEncoder.from_pretrained(model_dir, config, dev, dt)
    pooling = None
    if not isinstance(model, Scorer):
        # a decoder embedder without sentence-transformers' files pools as Qwen3-Embedding does
        decoder = isinstance(model, DecoderEncoder) and not (model_dir / "modules.json").exists()
        pooling = Pooling("last", normalize=True) if decoder else read_pooling(model_dir)
        pooling = override_pooling(pooling, pooler_config)
    elif pooler_config:
        raise ValueError("--pooler-config sets an embedding model's pooling; a cross-encoder does not pool")
    limit = max_input_tokens(model_dir, model.max_position)
    log.info(
        "%s model %s on %s (%s): %s, inputs up to %d tokens",
        "Embedding" if pooling else "Scoring",
        arch,
        dev,
        dt,
        f"{pooling.mode} pooling{', normalised' if pooling.normalize else ''}" if pooling else "pairs scored",
        limit,
    )
    kwargs = dict(
        device=dev.type,
        max_input_tokens=limit,
        dimensions=matryoshka_dimensions(config) if pooling else None,
        pair_template=template,
    )
    return model, pooling, kwargs
