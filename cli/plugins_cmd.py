"""``llmkit plugins``: every registered plugin with its kind, name, package and version."""

from __future__ import annotations

import json

import typer

from llmkit.cli.help_format import FlagCommand


def register(app: typer.Typer) -> None:
    @app.command("plugins", cls=FlagCommand)
    def plugins(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")):
        """List registered plugins (attention backends, models, parsers, storage, grammars)."""
        from llmkit.core.plugins import registry

        rows = [
            {"kind": e.kind, "name": e.name, "package": e.package, "version": e.version} for e in registry().entries()
        ]
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        widths = {k: max([len(k)] + [len(str(r[k])) for r in rows]) for k in ("kind", "name", "package", "version")}
        typer.echo("  ".join(k.upper().ljust(widths[k]) for k in widths))
        for r in rows:
            typer.echo("  ".join(str(r[k]).ljust(widths[k]) for k in widths))
