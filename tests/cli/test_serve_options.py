"""Each ``llmkit serve`` option is declared once, as a field of EngineConfig or ServerConfig whose
metadata carries its flags, help and check (issue 48): every option parameter reaches its field,
every field a user may set is an option, --help lists every flag, and the refusal module refuses
the same things, in the same words, for ``llmkit serve`` and for ``build_server``."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest
import typer
from typer.testing import CliRunner

from llmkit.cli.main import app
from llmkit.cli.option_table import Param, config_fields
from llmkit.cli.serve import _serve_only_app
from llmkit.cli.serve_options import SERVE_OPTIONS, build_configs
from llmkit.core.engine.config import EngineConfig
from llmkit.core.option import PANELS, OptionError, options
from llmkit.core.refusals import check_configs
from llmkit.core.server.config import ServerConfig

# The config fields no option sets by its own name, and why.
NOT_OPTIONS = {
    "engine.decode_log_interval": "how often the engine logs decode throughput",
    "engine.dp_rank": "set per data-parallel replica",
    "server.hf_model_id": "inferred at launch from the model's path or config",
    "server.warm_routes": "set at launch where the engine warms up (--skip/--enable-server-warmup)",
    "server.max_upload_size": "OpenAI's cap on /v1/files uploads",
    "server.max_prompt_list": "OpenAI's cap on a completions prompt list",
    "server.stream_include_usage_default": "OpenAI's default for stream_options.include_usage",
    "server.served_model_aliases": "the second and later --served-model-name",
    "server.enable_batches": "--batch-storage none",
    "server.model_source": "set at launch: the served weights' file or folder (Ollama's /api/show)",
}
FIELDS = [(cls, f, opt) for cls in (EngineConfig, ServerConfig) for f, opt in options(cls)]


def _parse(args: list[str]) -> dict:
    return typer.main.get_command(_serve_only_app()).make_context("serve", args).params


def _configs(params: dict) -> dict:
    engine, server = build_configs(params)
    return {
        **{f"engine.{f.name}": getattr(engine, f.name) for f in fields(engine)},
        **{f"server.{f.name}": getattr(server, f.name) for f in fields(server)},
    }


def _other_value(p: Param) -> list[str]:
    """Arguments giving the parameter a value other than its default, through its last alias."""
    flag = p.flags[-1]
    kind = next((t for t in typing.get_args(p.type) if t is not type(None)), p.type)
    if kind is bool:
        return [flag]
    if kind in (int, float):
        return [flag, str(3 if p.default is None else p.default + 2)]
    if kind is str:
        return [flag, "other"]
    return [flag, "a", flag, "b"]  # list[str]: a repeatable option


@pytest.mark.parametrize("cls, f, opt", FIELDS, ids=lambda x: getattr(x, "name", ""))
def test_every_option_field_declares_flags_help_panel_and_a_check_for_numbers(cls, f, opt):
    assert opt.flags and all(flag.startswith("--") for flag in opt.flags + opt.off_flags)
    assert opt.help and opt.help.strip().endswith((".", ")")), opt.flag
    assert opt.panel in PANELS
    if opt.off_flags:
        assert opt.off_help, opt.off_flags
    kind = typing.get_type_hints(cls)[f.name]
    if {int, float} & {kind, *typing.get_args(kind)}:
        assert opt.check is not None, f"{opt.flag}: a number needs its range checked"


@pytest.mark.parametrize("p", SERVE_OPTIONS, ids=lambda p: p.flags[0])
def test_every_parameter_reaches_its_field(p):
    defaults = _configs(_parse([]))
    params = _parse(_other_value(p))
    changed = {k for k, v in _configs(params).items() if v != defaults[k]}
    assert f"{p.config}.{p.field}" in changed, (p.flags, changed)
    if p.role == "value":  # the value arrives as given
        value = params[p.name]
        assert _configs(params)[f"{p.config}.{p.field}"] == (tuple(value) if p.repeated else value)


def test_every_settable_config_field_is_an_option():
    every = {f"engine.{f.name}" for f in fields(EngineConfig)} | {f"server.{f.name}" for f in fields(ServerConfig)}
    declared = {f"{p.config}.{p.field}" for p in SERVE_OPTIONS}
    assert every - declared == NOT_OPTIONS.keys()


def test_the_cli_defaults_are_the_fields():
    """No default is written twice: an empty command line gives the configs' own defaults."""
    engine, server = build_configs(_parse([]))
    assert engine == EngineConfig() and server == ServerConfig()


def test_options_name_distinct_flags():
    flags = [flag for _, _, opt in FIELDS for flag in opt.flags + opt.off_flags]
    assert len(flags) == len(set(flags))


def test_help_lists_every_flag():
    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=250).output
    for p in SERVE_OPTIONS:
        assert ",".join(p.flags) in out, p.flags


@pytest.mark.parametrize(
    "p", [p for p in SERVE_OPTIONS if (p.opt.off_envvar if p.role == "off" else p.opt.envvar)], ids=lambda p: p.name
)
def test_every_envvar_sets_its_option(p, monkeypatch):
    given = _parse(_other_value(p))[p.name]
    envvar = p.opt.off_envvar if p.role == "off" else p.opt.envvar
    monkeypatch.setenv(envvar, " ".join(given) if isinstance(given, list) else str(given))
    assert _parse([])[p.name] == given


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--dp", "2"], {"engine.dp_size": 2}),
        ([], {"engine.overlap_schedule": None, "engine.warmup": None, "server.served_model_name": ""}),
        (
            ["--disable-overlap-schedule", "--skip-server-warmup"],
            {"engine.overlap_schedule": False, "engine.warmup": False},
        ),
        (
            ["--enable-overlap-schedule", "--enable-server-warmup"],
            {"engine.overlap_schedule": True, "engine.warmup": True},
        ),
        (["--disable-metrics", "--disable-web-ui"], {"server.enable_metrics": False, "server.enable_web_ui": False}),
        (
            ["--served-model-name", "a", "--served-model-name", "b"],
            {"server.served_model_name": "a", "server.served_model_aliases": ("b",)},
        ),
        (["--api-key", "k1", "--api-key", "k2"], {"server.api_keys": ("k1", "k2")}),
    ],
)
def test_conversions(args, expected):
    configs = _configs(_parse(args))
    assert {k: configs[k] for k in expected} == expected


def test_implied_settings_apply_to_the_python_api_too(tmp_path):
    checked = check_configs(EngineConfig(), ServerConfig(batch_storage="none", lora_dir=str(tmp_path)))
    assert not checked.server.enable_batches and checked.server.batch_storage is None
    assert checked.engine.enable_lora  # adapters may be loaded at run time from the directory


def test_a_value_without_a_field_fails_loudly():
    params = _parse([])
    with pytest.raises(TypeError, match=r"without a field: \['new'\]"):
        build_configs({**params, "new": 1})
    with pytest.raises(TypeError, match=r"without a value: \['dtype'\]"):
        build_configs({k: v for k, v in params.items() if k != "dtype"})
    with pytest.raises(OptionError, match="contradict"):
        config_fields(SERVE_OPTIONS, _parse(["--enable-overlap-schedule", "--disable-overlap-schedule"]))


def test_lora_flags_take_several_values_after_one_flag():
    """SGLang's and vLLM's nargs form (--lora-paths a=x b=y) and the repeated form both work."""
    from llmkit.cli.help_format import spread_multi_values
    from llmkit.cli.serve_options import MULTI_VALUE_FLAGS

    assert MULTI_VALUE_FLAGS == {"--lora-paths", "--lora-modules", "--lora-target-modules"}
    args = ["--lora-paths", "a=/x", "b=/y", "--max-lora-rank", "8", "--lora-modules", "c=/z"]
    args += ["--lora-target-modules", "q_proj", "v_proj"]
    engine, _ = build_configs(_parse(spread_multi_values(args, MULTI_VALUE_FLAGS)))
    assert engine.lora_paths == ("a=/x", "b=/y", "c=/z")
    assert engine.lora_target_modules == ("q_proj", "v_proj") and engine.max_lora_rank == 8
    out = CliRunner().invoke(app, ["serve", "--lora-paths", "a=/x", "b=/y", "--lora-target-modules", "nope"])
    assert "--lora-target-modules: ['nope']" in out.output  # checked before any model loads


@pytest.mark.parametrize("ttl", [0, -1])
def test_batch_lease_ttl_must_be_positive(ttl):
    with pytest.raises(OptionError, match="--batch-lease-ttl must be positive"):
        check_configs(EngineConfig(), ServerConfig(batch_lease_ttl=ttl), listening=False)
