"""Build a ready-to-serve app from configuration (used by ``llmkit serve`` and tests)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from llmkit.core.server.chat_template import ChatTemplate
from llmkit.core.engine.config import EngineConfig
from llmkit.core.plugins import registry

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


def build_server(config: EngineConfig, *, api_key=None, chat_template=None, reasoning_parser=None,
                 tool_call_parser=None, grammar_backend="xgrammar", max_payload_size=32 << 20,
                 batch_storage: str | None = None, file_storage_path="./llmkit_storage", storage_options=(),
                 batch_max_in_flight: int = 4):
    """Load the model, start the engine thread and return the app. With ``batch_storage`` (a
    storage plugin name) the files and batches endpoints are mounted on that backend."""
    from llmkit.core.engine.loop import Engine
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.client import InProcessEngineClient
    from llmkit.core.model.source import EMBEDDED_NAME
    from llmkit.core.server.app import create_app
    from llmkit.core.server.state import ServerOptions, ServerState

    reg = registry()
    storage = None
    if batch_storage is not None:
        from llmkit.core.batches.storage import open_storage, parse_storage_options

        storage = open_storage(batch_storage, parse_storage_options(list(storage_options)),
                               file_storage_path=file_storage_path)
    if reasoning_parser:
        reg.entry("reasoning_parser", reasoning_parser)  # fail at start-up with the valid names
    if tool_call_parser:
        reg.entry("tool_parser", tool_call_parser)
    parts = build_engine_parts(config)
    tok = parts.tokenizer
    source = Path(chat_template).read_text() if chat_template else getattr(tok, "chat_template", None)
    template = ChatTemplate(source, tok.bos_token or "", tok.eos_token or "") if source else None
    from llmkit.core.server.tool_prompt import warn_if_no_tool_support

    warn_if_no_tool_support(template, tool_call_parser)
    engine = Engine(config, parts)
    engine.start()
    client = InProcessEngineClient(engine, config.max_queued_requests)
    name = config.served_model_name or config.model_path or EMBEDDED_NAME
    options = ServerOptions(served_model_name=name, api_key=api_key, reasoning_parser=reasoning_parser,
                            tool_call_parser=tool_call_parser, max_payload_size=max_payload_size)
    state = ServerState(client=client, tokenizer=tok, chat_template=template, options=options,
                        max_context=parts.max_context, vocab_size=parts.vocab_size,
                        sampling_defaults=_sampling_defaults(parts.model_dir))
    state.grammar = _grammar_backend(grammar_backend, tok, parts.vocab_size, parts.eos_token_ids)
    engine.sampler.grammar_backend = state.grammar

    def shutdown():
        engine.shutdown()
        if state.grammar is not None:
            state.grammar.close()

    return create_app(state, on_shutdown=shutdown, storage=storage, batch_max_in_flight=batch_max_in_flight)


def _grammar_backend(name: str, tokenizer, vocab_size: int, eos_ids):
    """The structured-output backend (``none``: constraint requests get a 400)."""
    if name == "none":
        return None
    from llmkit.core.grammar.contract import create_grammar_backend

    backend = create_grammar_backend(name, tokenizer=tokenizer, vocab_size=vocab_size,
                                     stop_token_ids=sorted(eos_ids))
    backend.warmup()  # start the compile workers now, not on the first constrained request
    return backend
