"""``llmkit serve``'s Typer parameters, generated from the config fields that declare them
(``core/option.py``): a field is an option's only declaration, this module only turns it into
Typer's form and a command line's values back into the two configs. Only typer and the config
modules are imported here, so ``llmkit --help`` stays fast.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from llmkit.core.option import PANELS, Option, OptionError, options


@dataclass(frozen=True)
class Param:
    """One Typer parameter: a field's flags (or, for a tri-state field, its on or its off flags)."""

    name: str  # the parameter's name in ``ctx.params``
    config: str  # "engine" or "server"
    field: str
    opt: Option
    role: str  # "value", "negate", "on", "off" or "spread"
    type: Any
    default: Any
    repeated: bool = False  # a tuple field, given as a repeated (or nargs) flag

    @property
    def flags(self) -> tuple[str, ...]:
        return self.opt.off_flags if self.role == "off" else self.opt.flags

    def typer_parameter(self) -> inspect.Parameter:
        off = self.role == "off"
        shown = self.opt.show_default or ("the plugin registered as default" if self.opt.plugin_default else None)
        extra = {"show_default": shown} if shown else {}
        option = typer.Option(
            *self.flags,
            envvar=self.opt.off_envvar if off else self.opt.envvar,
            help=self.opt.off_help if off else self.opt.help,
            rich_help_panel=self.opt.panel,
            **extra,
        )
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default, annotation=Annotated[self.type, option]
        )


def _cli_type(hint) -> Any:
    """The Typer type of a field's type: a tuple field takes its values repeated, as a list."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return Optional[list[args[0]]]
    if len(args) == 1 and type(None) in typing.get_args(hint):  # X | None
        return Optional[args[0]]
    return hint


def params_of(*configs: tuple[str, type]) -> tuple[Param, ...]:
    """Every serve parameter of the config classes, ordered by --help panel, then declaration."""
    out = []
    for config, cls in configs:
        hints = typing.get_type_hints(cls)
        for f, opt in options(cls):
            if opt.panel not in PANELS:
                raise ValueError(f"{opt.flag}: panel {opt.panel!r} is not one of {PANELS}")
            hint = hints[f.name]
            if opt.spread is not None:
                out.append(Param(f.name, config, f.name, opt, "spread", opt.cli_type, None))
            elif opt.negate:
                out.append(Param(f.name, config, f.name, opt, "negate", bool, False))
            elif opt.off_flags:
                out.append(Param(f.name, config, f.name, opt, "on", bool, False))
                out.append(Param(f"{f.name}_off", config, f.name, opt, "off", bool, False))
            else:
                repeated = typing.get_origin(hint) is tuple
                default = None if repeated else f.default
                out.append(Param(f.name, config, f.name, opt, "value", _cli_type(hint), default, repeated))
    return tuple(sorted(out, key=lambda p: PANELS.index(p.opt.panel)))


def config_fields(table: tuple[Param, ...], params: dict) -> tuple[dict, dict]:
    """The keyword arguments of ``EngineConfig`` and ``ServerConfig`` from ``params`` (every
    parameter's value by name): the conversions of the forms in :class:`Option`, nothing else."""
    names = {p.name for p in table}
    if params.keys() != names:
        raise TypeError(
            f"options without a field: {sorted(params.keys() - names)}; fields without a value: "
            f"{sorted(names - params.keys())}"
        )
    fields: dict[str, dict] = {"engine": {}, "server": {}}
    for p in table:
        value, out = params[p.name], fields[p.config]
        if p.role == "spread":
            out.update(p.opt.spread(value))
        elif p.role == "negate":
            out[p.field] = not value
        elif p.role == "on":
            off = params[f"{p.field}_off"]
            if value and off:
                raise OptionError(f"{p.opt.off_flags[0]} and {p.opt.flag} contradict each other: give one of them")
            out[p.field] = True if value else False if off else None
        # "off": read with its "on" parameter
        elif p.role == "value":  # a tuple field's values come as a list, or None when not given
            out[p.field] = tuple(value or ()) if p.repeated else value
    return fields["engine"], fields["server"]


def signature(table: tuple[Param, ...]) -> inspect.Signature:
    """A command's signature for Typer, which reads a command's parameters from ``inspect.signature``."""
    return inspect.Signature([p.typer_parameter() for p in table])


def multi_value_flags(table: tuple[Param, ...]) -> frozenset[str]:
    """The flags that take several values after one flag (``--lora-paths a=x b=y``)."""
    return frozenset(flag for p in table if p.opt.nargs for flag in p.flags)
