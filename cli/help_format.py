"""Help without a type on on/off flags: Typer 0.29 prints ``<bool>`` after every flag (``--help
<bool>``), which reads as if the flag took a value. Commands and groups built with these classes
show flags bare. ``serve`` also takes several values after one of its ``nargs`` options' flags."""

from __future__ import annotations

from typer.core import TyperCommand, TyperGroup


def _bare_flags(params: list) -> list:
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""  # shown in the type column instead of "<bool>"
    return params


def spread_multi_values(args: list[str], multi_value_flags: frozenset[str]) -> list[str]:
    """Options SGLang and vLLM declare with nargs (``--lora-paths a=x b=y``), which click cannot:
    each value after one of ``multi_value_flags`` is given the flag of its own, as click's
    repeatable options take them."""
    out, flag = [], None
    for arg in args:
        if arg.startswith("-"):
            flag = arg if arg in multi_value_flags else None
            out.append(arg)
        elif flag is not None and out[-1] != flag:
            out += [flag, arg]
        else:
            out.append(arg)
    return out


class FlagCommand(TyperCommand):
    multi_value_flags: frozenset[str] = frozenset()

    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_multi_values(args, self.multi_value_flags))


class FlagGroup(TyperGroup):
    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))
