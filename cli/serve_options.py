"""Every ``llmkit serve`` option: the Typer parameters generated from the fields of
``EngineConfig`` and ``ServerConfig`` that declare them (``core/option.py``), and the two configs
back from a command line's values."""

from __future__ import annotations

from llmkit.cli.option_table import config_fields, multi_value_flags, params_of
from llmkit.core.engine.config import EngineConfig
from llmkit.core.server.config import ServerConfig

SERVE_OPTIONS = params_of(("engine", EngineConfig), ("server", ServerConfig))
MULTI_VALUE_FLAGS = multi_value_flags(SERVE_OPTIONS)


def build_configs(params: dict) -> tuple[EngineConfig, ServerConfig]:
    """The engine and server configs from ``llmkit serve``'s options (``ctx.params``: every
    parameter's value by name); ``core/refusals.py`` checks them."""
    engine, server = config_fields(SERVE_OPTIONS, params)
    return EngineConfig(**engine), ServerConfig(**server)
