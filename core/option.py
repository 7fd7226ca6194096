"""A serve option is declared once: as a field of ``EngineConfig`` or ``ServerConfig`` whose
metadata carries its flags, help, environment variable, allowed values, check and panel (SGLang's
``ServerArgs`` is the anchor). The field's default is the option's only default.

``llmkit serve`` builds its Typer options from these fields (``cli/serve_options.py``),
``core/refusals.py`` runs their checks for the CLI and the Python API alike, and the docs'
option reference is generated from them. Nothing here imports Typer or torch, so ``llmkit
--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

# A check: the value (never None: an unset optional is not checked) -> what is wrong, or None.
# The message follows the flag: "--page-size" + " must be at least 1 (got 0)".
Check = Callable[[Any], "str | None"]

# The --help panels, in the order they are shown.
PANELS = (
    "Model and kernels",
    "HTTP server and limits",
    "Scheduling and memory",
    "Parallelism",
    "Speculative decoding",
    "LoRA adapters",
    "Batches and storage",
    "Embeddings and rerank",
    "Images",
    "Audio",
)


class OptionError(ValueError):
    """A user mistake in the options; the message is the whole report (it names the flag and what
    to do), shown as one line, never a traceback."""


@dataclass(frozen=True)
class Option:
    """How a config field is set from the command line. The value of the field's flags is the
    field's value, except for the forms below, each a conversion the CLI applies."""

    flags: tuple[str, ...]  # the first is the name shown in messages
    help: str
    panel: str
    envvar: str | None = None
    # Allowed values: a tuple, or "module:NAME" of the table that owns them (a dict's keys or a
    # tuple), imported only when checked; ``extra_choices`` are accepted beside them ("auto").
    choices: tuple[str, ...] | str | None = None
    extra_choices: tuple[str, ...] = ()
    plugin: str | None = None  # a plugin kind whose registered names are the allowed values
    plugin_default: bool = False  # None: the plugin of that kind registered as default
    check: Check | None = None
    # A field that defaults to True set off by a --disable-X flag (which defaults to False).
    negate: bool = False
    # A tri-state field (None: decided by the device): ``flags`` set it True, ``off_flags`` False.
    off_flags: tuple[str, ...] = ()
    off_help: str | None = None
    off_envvar: str | None = None
    # A value given several times (a tuple field): ``nargs`` takes several values after one flag,
    # as SGLang's and vLLM's ``--lora-paths a=x b=y``.
    nargs: bool = False
    # A value spread over several fields (the CLI value -> {field: value}), with the CLI type.
    spread: Callable[[Any], dict] | None = None
    cli_type: Any = None
    show_default: str | None = None  # shown in --help where the default is decided elsewhere
    generation_only: bool = False  # refused on an embedding or reranking model, which would ignore it

    @property
    def flag(self) -> str:
        return self.flags[0]


def option(default: Any, *flags: str, help: str, panel: str, **kw) -> Any:
    """A config field that is a serve option (see :class:`Option`)."""
    return dataclasses.field(default=default, metadata={"option": Option(flags, help, panel, **kw)})


def option_of(f: dataclasses.Field) -> Option | None:
    return f.metadata.get("option")


def options(config_cls) -> list[tuple[dataclasses.Field, Option]]:
    """The fields of ``config_cls`` that are serve options, in declaration order."""
    return [(f, option_of(f)) for f in dataclasses.fields(config_cls) if option_of(f) is not None]


def allowed(opt: Option) -> tuple[str, ...] | None:
    """The option's allowed values from the table that owns them (a plugin kind's registered
    names, with its extras); None where any value of its type goes."""
    if opt.plugin is not None:
        from llmkit.core.plugins import registry

        return tuple(dict.fromkeys([*opt.extra_choices, *registry().names(opt.plugin)]))
    if opt.choices is None:
        return None
    table = opt.choices
    if isinstance(table, str):
        import importlib

        module, _, name = table.partition(":")
        table = getattr(importlib.import_module(module), name)
    return tuple(dict.fromkeys([*opt.extra_choices, *table]))


# The checks options share.


def at_least(low: int) -> Check:
    return lambda v: None if v >= low else f"must be at least {low} (got {v})"


def positive(v) -> str | None:
    return None if v > 0 else f"must be positive (got {v})"


def non_negative(v) -> str | None:
    return None if v >= 0 else f"must be 0 or more (got {v})"


def fraction(v) -> str | None:
    return None if 0 < v < 1 else f"{v} must be between 0 and 1 (e.g. 0.8)"


def one_of(*values) -> Check:
    """For numbers (strings use ``choices``)."""
    return lambda v: None if v in values else f"{v} is not supported; valid: {', '.join(map(str, values))}"


def port(v) -> str | None:
    return None if 1 <= v <= 65535 else f"{v} is out of range: use a port from 1 to 65535"


def http_url(v) -> str | None:
    return None if v.startswith(("http://", "https://")) else f"{v!r} must be an http:// or https:// URL"


def host_port(v) -> str | None:
    host, _, number = v.rpartition(":")
    return None if host and number.isdigit() else f"'{v}' must be HOST:PORT"
