"""Whether a model serves embeddings or scores rather than text: its config names an encoder or
cross-encoder architecture, or ``--is-embedding`` / ``--is-reranker`` makes a causal LM one."""

from __future__ import annotations

from pathlib import Path

from llmkit.core.plugins import registry


def embedding_model_dir(model_path: str | None, forced: bool, reranker: bool = False) -> Path | None:
    """The model directory when the model serves embeddings or scores (its config names an encoder
    or cross-encoder architecture, or ``--is-embedding`` / ``--is-reranker`` makes a causal LM
    one); None for a generative model."""
    from llmkit.core.embedding.decoder import causal_architecture
    from llmkit.core.embedding.loader import encoder_architecture
    from llmkit.core.model.loader.embedded_encoder import embedded_encoder_dir, is_embedded_encoder
    from llmkit.core.model.loader.source import gguf_path_of, load_config

    flag = "--is-reranker" if reranker else "--is-embedding"
    if forced and reranker:
        raise ValueError("--is-embedding and --is-reranker: a model serves one of the two")
    if is_embedded_encoder(model_path) and not reranker:
        return embedded_encoder_dir()
    if model_path is None or gguf_path_of(model_path) is not None:
        if forced or reranker:
            raise ValueError(f"{flag} needs a model directory (the embedded model and GGUFs generate)")
        return None
    path = Path(model_path).expanduser()
    if not (path / "config.json").exists():
        return None  # the generation engine's loader says what is wrong with the path
    config = load_config(path)
    arch = encoder_architecture(config)
    if arch is not None:
        if reranker and not registry().entry("model", arch).meta.get("scores"):
            raise ValueError(f"--is-reranker: '{arch}' embeds; a cross-encoder or a causal LM reranks")
        return path
    if (forced or reranker) and causal_architecture(config) is not None:
        return path  # a causal LM as a last-token embedder or a yes/no reranker
    if forced or reranker:
        arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
        raise ValueError(f"{flag}: '{arch}' is neither an encoder nor a causal LM llmkit knows")
    return None
