"""One row of an option table: a command-line option and the config field its value fills.

A row is the option's only declaration (as SGLang's ``ServerArgs`` fields are): the Typer
parameter is generated from it, and so is the value's place in ``EngineConfig`` or
``ServerConfig``. Only typer is imported here, so ``llmkit --help`` stays fast.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Callable

import typer

CONFIGS = ("engine", "server")

# A conversion: (the option's value, every option's value by name) -> {"engine.<field>": value, ...}.
# A field it leaves out keeps the config's default.
Convert = Callable[[Any, dict], dict]


@dataclass(frozen=True)
class ServeOption:
    flags: tuple[str, ...]  # the first names the parameter: --model-path -> model_path
    type: Any  # what Typer converts the value to, e.g. Optional[int]
    default: Any
    # Where the value goes: "engine" or "server" (the field of the option's name), "engine.<field>",
    # "server.<field>", or a Convert for an option that is not one field's value.
    to: str | Convert
    help: str | None = None
    envvar: str | None = None
    typer_args: dict = field(default_factory=dict)  # further typer.Option arguments: min, show_default

    def __post_init__(self):
        if not callable(self.to) and self.to.partition(".")[0] not in CONFIGS:
            raise ValueError(f"{self.flags[0]}: 'to' must name engine or server (a field there), not {self.to!r}")

    @property
    def name(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def destinations(self, params: dict) -> dict:
        """``{"engine.<field>": value, ...}``: what this option's value sets, given every option's value."""
        value = params[self.name]
        if callable(self.to):
            return self.to(value, params)
        config, _, name = self.to.partition(".")
        return {f"{config}.{name or self.name}": value}

    def typer_parameter(self) -> inspect.Parameter:
        option = typer.Option(*self.flags, envvar=self.envvar, help=self.help, **self.typer_args)
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default, annotation=Annotated[self.type, option]
        )


def config_fields(table: tuple[ServeOption, ...], params: dict) -> tuple[dict, dict]:
    """The keyword arguments of ``EngineConfig`` and ``ServerConfig`` from ``params`` (every row's
    value by name). A parameter without a row, a row without a value, or two rows setting one field
    fail here; a field the config does not have fails in its constructor."""
    names = {row.name for row in table}
    if params.keys() != names:
        raise TypeError(
            f"options without a row: {sorted(params.keys() - names)}; rows without a value: {sorted(names - params.keys())}"
        )
    fields: dict[str, dict] = {config: {} for config in CONFIGS}
    for row in table:
        for dest, value in row.destinations(params).items():
            config, _, name = dest.partition(".")
            if name in fields[config]:
                raise ValueError(f"{row.flags[0]} sets {dest}, which another option set already")
            fields[config][name] = value
    return fields["engine"], fields["server"]


def panel(title: str, *rows: ServeOption) -> tuple[ServeOption, ...]:
    """``rows`` shown together under ``title`` in ``--help`` (one table per theme, as SGLang groups
    its arguments, instead of one list of ~90)."""
    return tuple(replace(r, typer_args={**r.typer_args, "rich_help_panel": title}) for r in rows)


def signature(table: tuple[ServeOption, ...]) -> inspect.Signature:
    """A command's signature for Typer, which reads a command's parameters from ``inspect.signature``."""
    return inspect.Signature([row.typer_parameter() for row in table])


def negated(dest: str) -> Convert:
    """A --disable-X flag that fills an enable_X field."""
    return lambda value, _: {dest: not value}


def only_when_given(dest: str, value: Any) -> Convert:
    """A flag that sets ``dest`` to ``value`` when given, and otherwise leaves its default (None:
    decided by the device), so a --disable-X and an --enable-X can share one field."""
    return lambda given, _: {dest: value} if given else {}


def accepted_only(value, _) -> dict:
    """An option accepted so that another server's command lines work, which sets nothing here."""
    return {}
