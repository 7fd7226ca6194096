"""Each ``llmkit serve`` option is declared once, as a row of cli/serve_options.py (issue 27): every
row reaches a config field, every config field a user may set has a row, and --help lists every
row's flags."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest
import typer
from typer.testing import CliRunner

from llmkit.cli.main import app
from llmkit.cli.option_table import ServeOption, accepted_only, config_fields
from llmkit.cli.serve import _serve_only_app
from llmkit.cli.serve_options import SERVE_OPTIONS, build_configs
from llmkit.core.engine.config import EngineConfig
from llmkit.core.server.config import ServerConfig

# The config fields no option sets, and why.
NOT_OPTIONS = {
    "engine.decode_log_interval": "how often the engine logs decode throughput",
    "engine.dp_rank": "set per data-parallel replica",
    "server.hf_model_id": "inferred at launch from the model's path or config",
    "server.warm_routes": "set at launch where the engine warms up (--skip/--enable-server-warmup)",
    "server.max_upload_size": "OpenAI's cap on /v1/files uploads",
    "server.max_prompt_list": "OpenAI's cap on a completions prompt list",
    "server.stream_include_usage_default": "OpenAI's default for stream_options.include_usage",
}


def _parse(args: list[str]) -> dict:
    return typer.main.get_command(_serve_only_app()).make_context("serve", args).params


def _configs(params: dict) -> dict:
    engine, server = build_configs(params)
    return {
        **{f"engine.{f.name}": getattr(engine, f.name) for f in fields(engine)},
        **{f"server.{f.name}": getattr(server, f.name) for f in fields(server)},
    }


def _other_value(row: ServeOption) -> list[str]:
    """Arguments giving the row a value other than its default, through its last alias."""
    flag = row.flags[-1]
    kind = next((t for t in typing.get_args(row.type) if t is not type(None)), row.type)
    if kind is bool:
        return [flag]
    if kind in (int, float):
        return [flag, str(3 if row.default is None else row.default + 2)]
    if kind is str:
        return [flag, "other"]
    return [flag, "a", flag, "b"]  # list[str]: a repeatable option


@pytest.mark.parametrize("row", SERVE_OPTIONS, ids=lambda row: row.flags[0])
def test_every_row_reaches_its_config_field(row):
    defaults = _configs(_parse([]))
    params = _parse(_other_value(row))
    changed = {k for k, v in _configs(params).items() if v != defaults[k]}
    if row.to is accepted_only:
        assert not changed
        return
    dests = row.destinations(params)
    assert changed & dests.keys(), (row.flags, changed, dests)
    if isinstance(row.to, str):  # one field: the value arrives as given
        [(dest, value)] = dests.items()
        assert _configs(params)[dest] == value == params[row.name] != defaults[dest]


def test_every_settable_config_field_has_a_row():
    params = {**_parse([]), **{row.name: True for row in SERVE_OPTIONS if row.type is bool}}
    reached = {dest for row in SERVE_OPTIONS for dest in row.destinations(params)}
    every = {f"engine.{f.name}" for f in fields(EngineConfig)} | {f"server.{f.name}" for f in fields(ServerConfig)}
    assert every - reached == NOT_OPTIONS.keys()


def test_rows_name_distinct_flags():
    flags = [flag for row in SERVE_OPTIONS for flag in row.flags]
    assert len(flags) == len(set(flags))


def test_help_lists_every_row():
    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=250).output
    for row in SERVE_OPTIONS:
        assert ",".join(row.flags) in out, row.flags


@pytest.mark.parametrize("row", [r for r in SERVE_OPTIONS if r.envvar], ids=lambda row: row.envvar)
def test_every_envvar_sets_its_option(row, monkeypatch):
    given = _parse(_other_value(row))[row.name]
    monkeypatch.setenv(row.envvar, " ".join(given) if isinstance(given, list) else str(given))
    assert _parse([])[row.name] == given


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--batch-storage", "none"], {"server.enable_batches": False, "server.batch_storage": None}),
        (["--dp", "2"], {"engine.engine_process": True, "engine.dp_size": 2}),
        (["--tp-size", "2"], {"engine.engine_process": True}),
        ([], {"engine.overlap_schedule": None, "engine.warmup": None, "server.served_model_name": ""}),
        (
            ["--disable-overlap-schedule", "--skip-server-warmup"],
            {"engine.overlap_schedule": False, "engine.warmup": False},
        ),
    ],
)
def test_conversions(args, expected):
    configs = _configs(_parse(args))
    assert {k: configs[k] for k in expected} == expected


def test_a_value_without_a_place_fails_loudly():
    with pytest.raises(TypeError):
        ServeOption(("--new",), int, 1)  # no destination
    with pytest.raises(ValueError, match="engine or server"):
        ServeOption(("--new",), int, 1, to="engnie")
    params = _parse([])
    with pytest.raises(TypeError, match=r"without a row: \['new'\]"):
        build_configs({**params, "new": 1})
    with pytest.raises(TypeError, match=r"without a value: \['dtype'\]"):
        build_configs({k: v for k, v in params.items() if k != "dtype"})
    engine, _ = config_fields((*SERVE_OPTIONS, ServeOption(("--new",), int, 1, to="engine")), {**params, "new": 1})
    with pytest.raises(TypeError, match="new"):
        EngineConfig(**engine)  # no such field
    with pytest.raises(ValueError, match="another option set already"):
        build_configs(_parse(["--enable-overlap-schedule", "--disable-overlap-schedule"]))


def test_lora_flags_take_several_values_after_one_flag():
    """SGLang's and vLLM's nargs form (--lora-paths a=x b=y) and the repeated form both work."""
    from llmkit.cli.help_format import spread_multi_values

    args = ["--lora-paths", "a=/x", "b=/y", "--max-lora-rank", "8", "--lora-modules", "c=/z"]
    args += ["--lora-target-modules", "q_proj", "v_proj"]
    engine, _ = build_configs(_parse(spread_multi_values(args)))
    assert engine.lora_paths == ("a=/x", "b=/y", "c=/z")
    assert engine.lora_target_modules == ("q_proj", "v_proj") and engine.max_lora_rank == 8
    out = CliRunner().invoke(app, ["serve", "--lora-paths", "a=/x", "b=/y", "--lora-target-modules", "nope"])
    assert "--lora-target-modules: ['nope']" in out.output  # checked before any model loads


@pytest.mark.parametrize("ttl", [0, -1])
def test_batch_lease_ttl_must_be_positive(ttl):
    from llmkit.cli.preflight import OptionError, check_serve_options

    params = {row.name: row.default for row in SERVE_OPTIONS} | {"batch_lease_ttl": ttl}
    with pytest.raises(OptionError, match="--batch-lease-ttl must be positive"):
        check_serve_options(params, check_port=False)
