"""The one module on top: wires the engine, the OpenAI server and Files & Batches together.

``build_server`` is used by ``llmkit serve`` and ``llmkit batch run``; everything below it
(server, batches, engine) is built from the two frozen configs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from llmkit.core.engine.config import EngineConfig
from llmkit.core.plugins import registry
from llmkit.core.server.config import ServerConfig

log = logging.getLogger("llmkit")


def _sampling_defaults(model_dir: Path) -> dict:
    """Defaults from the model's generation_config.json (SGLang's ``--sampling-defaults model``)."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    cfg = json.loads(path.read_text())
    out = {}
    for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if isinstance(cfg.get(k), (int, float)):
            out[k] = cfg[k]
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def check_server_config(config: ServerConfig) -> None:
    """Fail on unknown plugin names before the (slow) model load, listing the valid names."""
    reg = registry()
    if config.reasoning_parser:
        reg.entry("reasoning_parser", config.reasoning_parser)
    if config.tool_call_parser:
        reg.entry("tool_parser", config.tool_call_parser)
    if config.enable_batches:
        reg.entry("storage", config.batch_storage or reg.default("storage"))


def build_server(engine_config: EngineConfig, config: ServerConfig):
    """Load the model, start the engine thread and return the FastAPI app (its ``state.llmkit``
    is the :class:`ServerState`; ``state.shutdown()`` stops the engine)."""
    from llmkit.core.model.loader.hf_model_id import hf_model_id
    from llmkit.core.model.loader.source import EMBEDDED_NAME
    from llmkit.core.server.app import create_app
    from llmkit.core.server.prompts.chat_template import ChatTemplate
    from llmkit.core.server.state import ServerState

    check_server_config(config)
    storage = None
    if config.enable_batches:
        from llmkit.core.batches.storage import open_storage, parse_storage_options

        storage = open_storage(
            config.batch_storage or registry().default("storage"),
            parse_storage_options(list(config.storage_options)),
            file_storage_path=config.file_storage_path,
        )
    client, model_dir = _start_engine(engine_config)
    tok = client.tokenizer
    source = Path(config.chat_template).read_text() if config.chat_template else getattr(tok, "chat_template", None)
    template = ChatTemplate(source, tok.bos_token or "", tok.eos_token or "") if source else None
    from llmkit.core.server.prompts.tool_prompt import warn_if_no_tool_support

    warn_if_no_tool_support(template, config.tool_call_parser)
    if not config.served_model_name:
        config = replace(config, served_model_name=engine_config.model_path or EMBEDDED_NAME)
    config = replace(config, hf_model_id=config.hf_model_id or hf_model_id(engine_config.model_path))
    warm = engine_config.warmup
    config = replace(config, warm_routes=client.stats().get("device") == "cuda" if warm is None else warm)
    state = ServerState(
        client=client,
        tokenizer=tok,
        chat_template=template,
        options=config,
        max_context=client.max_context,
        vocab_size=client.vocab_size,
        sampling_defaults=_sampling_defaults(model_dir),
    )
    services, routers = [], []
    if storage is not None:
        services, routers = _batches(state, storage, config.batch_max_in_flight)

    def shutdown():
        client.shutdown()
        if storage is not None:
            storage.close()

    app = create_app(state, on_shutdown=shutdown, services=services, routers=routers, storage=storage)
    if state.metrics is not None:
        for service in services:  # the batch runner: lines in flight and queued, read at scrape time
            state.metrics.sources.append(service.line_counts)
    return app


def _start_engine(config: EngineConfig):
    """The engine and its client: on a thread of this process, in its own process
    (``--engine-process``), or as ``--dp-size`` replicas in their own processes. Returns the client and the model directory."""
    if config.dp_size > 1:
        from llmkit.core.engine.procs.dp_client import DataParallelClient

        client = DataParallelClient.start(config)
        return client, client.model_dir
    if config.engine_process:
        from llmkit.core.engine.procs.process_client import ProcessEngineClient

        client = ProcessEngineClient(config, config.max_queued_requests)
        return client, client.model_dir
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.client import InProcessEngineClient
    from llmkit.core.engine.loop import Engine

    engine, parts = Engine.build_and_start(config, lambda: build_engine_parts(config))
    return InProcessEngineClient(engine, config.max_queued_requests), parts.model_dir


def _batches(state, storage, max_in_flight: int):
    """The batch runner (started and stopped with the app) and the files and batches routes."""
    from llmkit.core.batches.batches_routes import batches_router, protocol_body_validator
    from llmkit.core.batches.executor import make_batch_executor
    from llmkit.core.batches.files_routes import files_router
    from llmkit.core.batches.runner import BatchRunner

    runner = BatchRunner(
        storage, make_batch_executor(state), max_in_flight=max_in_flight, body_validator=protocol_body_validator
    )
    return [runner], [
        files_router(storage, max_upload_bytes=state.options.max_upload_size),
        batches_router(runner),
    ]
