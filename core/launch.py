"""The one module on top: wires the engine, the OpenAI server and Files & Batches together.

``build_server`` is used by ``llmkit serve`` and ``llmkit batch run``; everything below it
(server, batches, engine) is built from the two frozen configs.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from llmkit.core.engine.config import EngineConfig
from llmkit.core.plugins import registry
from llmkit.core.refusals import Checked, check_configs
from llmkit.core.server.config import ServerConfig

log = logging.getLogger("llmkit")


def build_server(engine_config: EngineConfig, config: ServerConfig, *, listening: bool = True):
    """Check the configs (``core/refusals.py``, as ``llmkit serve`` does), load the model, start the
    engine thread and return the FastAPI app (its ``state.llmkit`` is the :class:`ServerState`;
    ``state.shutdown()`` stops the engine)."""
    return build_checked_server(check_configs(engine_config, config, listening=listening))


def build_checked_server(checked: Checked):
    """:func:`build_server` for configs :func:`check_configs` passed (``llmkit serve`` checks
    them, then binds its socket, before this slow part)."""
    from llmkit.core.lora.options import parse_lora_paths
    from llmkit.core.model.loader.hf_model_id import hf_model_id
    from llmkit.core.model.loader.source import EMBEDDED_NAME
    from llmkit.core.server.generation.sampling_defaults import load_sampling_defaults
    from llmkit.core.server.prompts.chat_template import ChatTemplate
    from llmkit.core.server.state import ServerState

    engine_config, config, embedding_dir = checked.engine, checked.server, checked.embedding_dir
    storage = _open_storage(config) if config.enable_batches else None
    if embedding_dir is not None:
        return _build_embedding_server(engine_config, config, embedding_dir, storage)
    from llmkit.core.speech.loader import speech_model_dir

    speech_dir = speech_model_dir(engine_config.model_path)
    if speech_dir is not None:
        if storage is not None:
            storage.close()  # a batch line is a chat or completions one: nothing a speech model serves
        return _build_speech_server(engine_config, config, speech_dir)
    client, model_dir = _start_engine(engine_config)
    tok = client.tokenizer
    source = Path(config.chat_template).read_text() if config.chat_template else getattr(tok, "chat_template", None)
    template = ChatTemplate(source, tok.bos_token or "", tok.eos_token or "") if source else None
    from llmkit.core.server.prompts.tool_prompt import warn_if_no_tool_support

    warn_if_no_tool_support(template, config.tool_call_parser)
    if not config.served_model_name:
        config = replace(config, served_model_name=engine_config.model_path or EMBEDDED_NAME)
    config = replace(config, hf_model_id=config.hf_model_id or hf_model_id(engine_config.model_path))
    from llmkit.core.model.loader.source import gguf_path_of

    config = replace(config, model_source=str(gguf_path_of(engine_config.model_path) or model_dir))
    warm = engine_config.warmup
    config = replace(config, warm_routes=client.stats().get("device") == "cuda" if warm is None else warm)
    state = ServerState(
        client=client,
        tokenizer=tok,
        chat_template=template,
        options=config,
        max_context=client.max_context,
        vocab_size=client.vocab_size,
        sampling_defaults=load_sampling_defaults(config.generation_config, model_dir),
        loras=dict(parse_lora_paths(engine_config.lora_paths)),  # the engine loaded them, or failed
    )
    state.mm, state.media = _multimodal(model_dir, tok, config, engine_config.tp_size)
    from llmkit.core.server.lora.resolver import open_resolver

    state.lora_resolver = open_resolver(config, storage)
    services, routers = [], []
    if storage is not None:
        services, routers = _batches(state, storage, config)

    def shutdown():
        client.shutdown()
        if storage is not None:
            storage.close()

    return _app(state, shutdown, services, routers, storage)


def _multimodal(model_dir: Path, tokenizer, config: ServerConfig, tp_size: int = 1):
    """A vision-language model's processor (None for a text model, or one the engine serves as
    text: ``plan.model_class``) and the media policy."""
    from llmkit.core.engine.stages.plan import model_class
    from llmkit.core.model.loader.source import load_config

    processor = None
    if (Path(model_dir) / "config.json").exists():
        hf = load_config(Path(model_dir))
        arch = (hf.get("architectures") or [None])[0]
        try:
            cls = model_class(hf, tp_size) if arch else None
        except Exception:  # the engine resolved the model by its model_type: not a vision one
            cls = None
        if getattr(cls, "multimodal", False):
            processor = cls.processor(str(model_dir), hf, tokenizer)
    return processor, media_policy(config, processor)


def media_policy(config: ServerConfig, processor=None):
    """The image policy of ``config``; the pixel cap, unless given, twice what ``processor`` keeps
    (at least 16 Mi pixels: a 4K screenshot or a 12 MP photo of a model that keeps fewer)."""
    from llmkit.core.multimodal.media import DEFAULT_MAX_PIXELS, MediaPolicy

    max_pixels = config.max_image_pixels
    if max_pixels is None:
        max_pixels = max(DEFAULT_MAX_PIXELS, 2 * (getattr(processor, "max_pixels", None) or 0))
    return MediaPolicy(
        allowed_domains=tuple(config.allowed_media_domains),
        allowed_local_path=config.allowed_local_media_path,
        max_bytes=config.max_image_bytes,
        max_pixels=max_pixels,
        max_images=config.max_images_per_request,
        timeout=config.media_fetch_timeout,
    )


def _app(state, shutdown, services, routers, storage):
    from llmkit.core.server.app import create_app

    app = create_app(state, on_shutdown=shutdown, services=services, routers=routers, storage=storage)
    if state.metrics is not None:
        for service in services:  # the batch runner: lines in flight and queued, read at scrape time
            state.metrics.sources.append(service.line_counts)
    return app


def _open_storage(config: ServerConfig):
    from llmkit.core.batches.storage import open_storage, parse_storage_options

    return open_storage(
        config.batch_storage or registry().default("storage"),
        parse_storage_options(list(config.storage_options)),
        file_storage_path=config.file_storage_path,
    )


def _build_embedding_server(engine_config: EngineConfig, config: ServerConfig, model_dir: Path, storage):
    """An embedding model behind /v1/embeddings (or a reranker behind /v1/rerank and /v1/score),
    and Batches of embeddings lines with ``storage``: an :class:`EmbeddingEngine` stands where the
    generation engine's client would, with no KV cache and no decode loop."""
    from transformers import AutoTokenizer

    from llmkit.core.embedding.loader import start_embedding_engine
    from llmkit.core.model.loader.embedded_encoder import ENCODER_HF_ID, is_embedded_encoder
    from llmkit.core.model.loader.hf_model_id import hf_model_id
    from llmkit.core.model.loader.source import load_config
    from llmkit.core.server.state import ServerState

    model_config = load_config(model_dir)
    engine = start_embedding_engine(
        model_dir,
        model_config,
        device=engine_config.device,
        dtype=engine_config.dtype,
        reranker=config.is_reranker,
        pooler_config=config.pooler_config,
        instruction=config.rerank_instruction,
    )
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok("warm", add_special_tokens=True)  # sets the tokenizer's truncation once, before threads share it
    path = engine_config.model_path
    hf_id = config.hf_model_id or (ENCODER_HF_ID if is_embedded_encoder(path) else hf_model_id(path))
    config = replace(
        config,
        served_model_name=config.served_model_name or path,
        hf_model_id=hf_id,
        model_source=str(model_dir),
        is_embedding=True,
        warm_routes=False,  # the warm-up requests are chat ones
        enable_web_ui=False,  # the playground is a chat page
    )
    state = ServerState(
        client=engine,
        tokenizer=tok,
        chat_template=None,
        options=config,
        max_context=engine.max_input_tokens,
        vocab_size=model_config["vocab_size"],
        embedder=engine,
    )
    services, routers = [], []
    if storage is not None and engine.kind != "embed":
        log.info("Files and Batches are not served for rerankers: a batch line is an embeddings one")
        storage.close()
        storage = None
    if storage is not None:
        from llmkit.core.batches.validation import EMBEDDING_ENDPOINTS

        services, routers = _batches(state, storage, config, EMBEDDING_ENDPOINTS)

    def shutdown():
        engine.shutdown()
        if storage is not None:
            storage.close()

    return _app(state, shutdown, services, routers, storage)


def _build_speech_server(engine_config: EngineConfig, config: ServerConfig, model_dir: Path):
    """A speech-to-text model (Whisper) behind /v1/audio/transcriptions and /translations: a
    :class:`SpeechEngine` stands where the generation engine's client would."""
    from llmkit.core.model.loader.hf_model_id import hf_model_id
    from llmkit.core.model.loader.source import load_config
    from llmkit.core.server.state import ServerState
    from llmkit.core.speech.loader import start_speech_engine

    model_config = load_config(model_dir)
    import torch

    device = engine_config.device
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = engine_config.dtype if engine_config.dtype not in (None, "auto") else "float32"
    engine, tok = start_speech_engine(model_dir, device=device, dtype=dtype)
    path = engine_config.model_path
    config = replace(
        config,
        served_model_name=config.served_model_name or path,
        hf_model_id=config.hf_model_id or hf_model_id(path),
        model_source=str(model_dir),
        warm_routes=False,  # the warm-up requests are chat ones
        enable_web_ui=False,  # the playground is a chat page
    )
    state = ServerState(
        client=engine,
        tokenizer=tok,
        chat_template=None,
        options=config,
        max_context=model_config.get("max_target_positions", 448),
        vocab_size=model_config["vocab_size"],
        speech=engine,
    )
    return _app(state, engine.shutdown, [], [], None)


def _start_engine(config: EngineConfig):
    """The engine and its client: on a thread of this process, in its own process
    (``--engine-process``), or as ``--dp-size`` replicas in their own processes. Returns the client and the model directory."""
    if config.dp_size > 1:
        from llmkit.core.engine.procs.dp_client import DataParallelClient

        client = DataParallelClient.start(config)
        return client, client.model_dir
    if config.engine_process or config.tp_size > 1:  # tensor-parallel ranks run in processes of their own
        from llmkit.core.engine.procs.process_client import ProcessEngineClient

        client = ProcessEngineClient(config, config.max_queued_requests)
        return client, client.model_dir
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.client import InProcessEngineClient
    from llmkit.core.engine.loop import Engine

    engine, parts = Engine.build_and_start(config, lambda: build_engine_parts(config))
    return InProcessEngineClient(engine, config.max_queued_requests), parts.model_dir


def _batches(state, storage, config: ServerConfig, endpoints: tuple[str, ...] | None = None):
    """The batch runner (started and stopped with the app) and the files and batches routes
    (batches of ``endpoints``: the chat and completions ones by default)."""
    from llmkit.core.batches.batches_routes import batches_router, protocol_body_validator
    from llmkit.core.batches.executor import make_batch_executor
    from llmkit.core.batches.files_routes import files_router
    from llmkit.core.batches.runner import BatchRunner

    runner = BatchRunner(
        storage,
        make_batch_executor(state),
        max_in_flight=config.batch_max_in_flight,
        body_validator=protocol_body_validator,
        lease_ttl=config.batch_lease_ttl,
    )
    return [runner], [
        files_router(storage, max_upload_bytes=state.options.max_upload_size),
        batches_router(runner, **({"endpoints": endpoints} if endpoints else {})),
    ]
