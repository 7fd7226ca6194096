"""The ``llmkit`` command. Subcommands live in their own modules; nothing here imports torch."""

from __future__ import annotations

import typer

from llmkit.cli import batch, bench, gateway, plugins_cmd, serve
from llmkit.cli.help_format import FlagGroup


def _help_width() -> None:
    """Rich renders help at 80 columns when piped and squeezes long flag names into
    '--enable-deterministic-infe…'; a floor of 120 columns keeps every name whole."""
    import os
    import shutil

    if os.environ.get("TERMINAL_WIDTH"):
        return
    import typer.rich_utils

    typer.rich_utils.MAX_WIDTH = max(shutil.get_terminal_size((80, 24)).columns, 120)


_help_width()
app = typer.Typer(
    name="llmkit",
    cls=FlagGroup,
    help="llmkit: a plugin-architecture LLM server with an OpenAI API.",
    no_args_is_help=True,
    add_completion=False,
)
serve.register(app)
plugins_cmd.register(app)
batch.register(app)
bench.register(app)
gateway.register(app)


def _add_plugin_commands() -> None:
    # Plugins may add commands; loading them must stay cheap (no torch at import time).
    try:
        from llmkit.core.plugins import get_plugin_manager

        get_plugin_manager().hook.llmkit_register_commands(app=app)
    except Exception as exc:  # a broken plugin should not break `llmkit --help`
        typer.echo(f"warning: plugin commands unavailable: {exc}", err=True)


def main() -> None:
    _add_plugin_commands()
    app()


if __name__ == "__main__":
    main()
