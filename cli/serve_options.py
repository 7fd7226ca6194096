"""Every ``llmkit serve`` option, declared once: its flags (SGLang's names where one exists, so
command lines pasted from its docs work), envvar, type, default, help, and the config field it
fills. ``serve``'s parameters and :func:`build_configs` are generated from this table; the rows
live in ``cli/options/``, a module (and a ``--help`` panel) a theme."""

from __future__ import annotations

from llmkit.cli.option_table import config_fields
from llmkit.cli.options.batches import BATCH_OPTIONS
from llmkit.cli.options.embedding import EMBEDDING_OPTIONS
from llmkit.cli.options.engine import ENGINE_OPTIONS
from llmkit.cli.options.lora import LORA_OPTIONS
from llmkit.cli.options.media import MEDIA_OPTIONS
from llmkit.cli.options.model import MODEL_OPTIONS
from llmkit.cli.options.parallel import PARALLEL_OPTIONS
from llmkit.cli.options.server import SERVER_OPTIONS
from llmkit.cli.options.speculative import SPECULATIVE_OPTIONS

SERVE_OPTIONS = (
    MODEL_OPTIONS
    + SERVER_OPTIONS
    + ENGINE_OPTIONS
    + PARALLEL_OPTIONS
    + SPECULATIVE_OPTIONS
    + LORA_OPTIONS
    + BATCH_OPTIONS
    + EMBEDDING_OPTIONS
    + MEDIA_OPTIONS
)


def build_configs(params: dict):
    """The engine and server configs from ``llmkit serve``'s options (``ctx.params``: every row's
    value by name), checked first by ``check_serve_options``."""
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.server.config import ServerConfig

    engine, server = config_fields(SERVE_OPTIONS, params)
    return EngineConfig(**engine), ServerConfig(**server)
