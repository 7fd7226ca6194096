"""Help without a type on on/off flags: Typer 0.29 prints ``<bool>`` after every flag (``--help
<bool>``), which reads as if the flag took a value. Commands and groups built with these classes
show flags bare."""

from __future__ import annotations

from typer.core import TyperCommand, TyperGroup


def _bare_flags(params: list) -> list:
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""  # shown in the type column instead of "<bool>"
    return params


class FlagCommand(TyperCommand):
    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))


class FlagGroup(TyperGroup):
    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))
