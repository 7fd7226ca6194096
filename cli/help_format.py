"""Help without a type on on/off flags: Typer 0.29 prints ``<bool>`` after every flag (``--help
<bool>``), which reads as if the flag took a value. Commands and groups built with these classes
show flags bare. Commands also take several values after one of :data:`MULTI_VALUE_FLAGS`."""

from __future__ import annotations

from typer.core import TyperCommand, TyperGroup


def _bare_flags(params: list) -> list:
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""  # shown in the type column instead of "<bool>"
    return params


# Options SGLang and vLLM declare with nargs (``--lora-paths a=x b=y``), which click cannot: each
# value after one of these flags is given the flag of its own, as click's repeatable options take them.
MULTI_VALUE_FLAGS = frozenset({"--lora-paths", "--lora-modules", "--lora-target-modules"})


def spread_multi_values(args: list[str]) -> list[str]:
    out, flag = [], None
    for arg in args:
        if arg.startswith("-"):
            flag = arg if arg in MULTI_VALUE_FLAGS else None
            out.append(arg)
        elif flag is not None and out[-1] != flag:
            out += [flag, arg]
        else:
            out.append(arg)
    return out


class FlagCommand(TyperCommand):
    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_multi_values(args))


class FlagGroup(TyperGroup):
    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))
