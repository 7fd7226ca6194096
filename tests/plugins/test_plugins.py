"""The plugin system: built-ins and a real third-party distribution installed through an entry
point, selected by name in a running server; `llmkit plugins`; cheap `llmkit --help`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from llmkit.core.model.loader.source import resolve_model_dir

from model_utils import tiny_config
from server_utils import server_log, start_server, stop_server

TOY = Path(__file__).parent / "llmkit_toy"


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "--target",
            str(target),
            str(TOY),
        ],
        check=True,
    )
    return target


def _env(site: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_llmkit_plugins_lists_builtins_and_third_party(toy_site):
    out = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "plugins", "--json"],
        env=_env(toy_site),
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {(r["kind"], r["name"]): r for r in json.loads(out.stdout)}
    assert rows[("attention", "toy")]["package"] == "llmkit-toy-plugin"
    assert rows[("attention", "toy")]["version"] == "0.3.1"
    assert rows[("model", "ToyLlamaForCausalLM")]["package"] == "llmkit-toy-plugin"
    assert rows[("kv_storage", "toy-flat")]["package"] == "llmkit-toy-plugin"
    for kind, name in [
        ("attention", "torch"),
        ("model", "LlamaForCausalLM"),
        ("model", "Qwen2ForCausalLM"),
        ("model", "Qwen3ForCausalLM"),
        ("reasoning_parser", "qwen3"),
        ("tool_parser", "hermes"),
        ("storage", "local"),
        ("kv_storage", "file"),
        ("kv_storage", "redis"),
    ]:
        assert rows[(kind, name)]["package"] == "llmkit"
    table = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "plugins"],
        env=_env(toy_site),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "llmkit-toy-plugin" in table and "KIND" in table


def test_disable_autoload_hides_third_party(toy_site):
    env = {**_env(toy_site), "LLMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "plugins", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    names = {r["name"] for r in json.loads(out.stdout)}
    assert "toy" not in names and "torch" in names


def test_third_party_backend_and_model_serve(toy_site, tmp_path):
    import transformers

    torch = pytest.importorskip("torch")
    cfg = tiny_config("llama")
    cfg.vocab_size = 49152
    cfg.architectures = ["ToyLlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(tmp_path))
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    cfg_json["architectures"] = ["ToyLlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    src = resolve_model_dir(None)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    proc, url = start_server(
        [
            "--model-path",
            str(tmp_path),
            "--attention",
            "toy",
            "--batch-storage",
            "none",
            "--reasoning-parser",
            "toy-think",
            "--tool-call-parser",
            "toy-call",
            "--grammar-backend",
            "toy-choice",
        ],
        env={"PYTHONPATH": _env(toy_site)["PYTHONPATH"]},
    )
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="m", prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        log = server_log(proc, tail=100_000)
        assert "ToyLlamaForCausalLM" in log and "attention toy" in log
        assert "toy attention backend in use" in log
        # The toy grammar backend constrains a random model to one of the alternatives.
        for seed in range(3):
            r = client.completions.create(
                model="m", prompt="Answer:", max_tokens=8, seed=seed, extra_body={"regex": "yes|no"}
            )
            assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "regex": "[a-z]+"}, timeout=30)
        assert bad.status_code == 400 and "literal alternatives" in bad.json()["error"]["message"]
        # The toy parsers answer the parser routes.
        sep = httpx.post(
            url + "/separate_reasoning",
            timeout=30,
            json={"text": "<toy>let me see</toy>It is 4.", "reasoning_parser": "toy-think"},
        ).json()
        assert sep == {"reasoning_text": "let me see", "text": "It is 4."}
        calls = httpx.post(
            url + "/parse_function_call",
            timeout=30,
            json={
                "text": 'Sure.\nCALL add {"a": 1}',
                "tool_call_parser": "toy-call",
                "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
            },
        ).json()
        assert calls["normal_text"] == "Sure." and calls["calls"][0]["name"] == "add"
    finally:
        stop_server(proc)


def test_third_party_lora_resolver(toy_site, tmp_path):
    """``--lora-resolver toy-shelf``: a request naming ``shelf-a`` loads what the plugin found."""
    from lora_utils import save_adapter, save_tiny_llama

    save_tiny_llama(tmp_path / "base")
    save_adapter(tmp_path / "base", tmp_path / "shelf" / "a", seed=1, r=4)
    proc, url = start_server(
        ["--model-path", str(tmp_path / "base"), "--device", "cpu", "--lora-resolver", "toy-shelf"],
        env={"PYTHONPATH": _env(toy_site)["PYTHONPATH"], "TOY_LORA_SHELF": str(tmp_path / "shelf")},
    )
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        base = client.completions.create(model="m", prompt="Hello there", max_tokens=6, temperature=0)
        r = client.completions.create(model="shelf-a", prompt="Hello there", max_tokens=6, temperature=0)
        assert r.choices[0].text != base.choices[0].text  # the adapter it found changes the output
        assert "shelf-a" in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="shelf-none", prompt="Hello", max_tokens=2)
    finally:
        stop_server(proc)


def test_help_does_not_import_torch():
    code = (
        "import sys, runpy; sys.argv=['llmkit','--help']\n"
        "try:\n runpy.run_module('llmkit.cli.main', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_unknown_names_list_valid_ones():
    from llmkit.core.plugins import PluginError, registry

    with pytest.raises(PluginError, match="valid names: .*torch"):
        registry().attention_backend("nope")
    with pytest.raises(PluginError, match="qwen3"):
        registry().reasoning_parser("nope")


def test_duplicate_registration_names_both_plugins():
    from llmkit.core import plugins
    from llmkit.core.hookspecs import hookimpl

    class Dup:
        @hookimpl
        def llmkit_register_attention_backends(self, register):
            register("torch", "x:y")

    pm = plugins.get_plugin_manager()
    pm.register(Dup(), name="dup-test")
    try:
        with pytest.raises(plugins.PluginError, match="registered twice.*dup-test"):
            plugins.Registry(pm, {})
    finally:
        pm.unregister(name="dup-test")


def test_third_party_command(toy_site):
    """``llmkit_register_commands``: a plugin's Typer command runs from the ``llmkit`` CLI."""
    out = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "toy-hello", "--name", "llmkit"],
        env=_env(toy_site),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello llmkit from llmkit-toy"
    helptext = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "--help"],
        env=_env(toy_site),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "toy-hello" in helptext


def test_plugin_declared_metadata_drives_the_defaults():
    """Core names no plugin: auto attention order, model types and defaults come from metadata."""
    from llmkit.core.plugins import registry

    reg = registry()
    assert reg.auto_attention("cuda") == ["triton", "flashinfer", "torch"]
    assert reg.auto_attention("cpu") == ["torch"]
    assert reg.architecture_for_model_type("qwen3") == "Qwen3ForCausalLM"
    assert reg.architecture_for_model_type("nope") is None
    assert reg.default("grammar") == "xgrammar" and reg.default("storage") == "local"
    core = Path(__file__).resolve().parents[2] / "core"
    for name in ('"xgrammar"', '"local"', '"triton"', '"LlamaForCausalLM"'):
        # (asking whether the triton *package* is installed is not naming the plugin)
        hits = [p for p in core.rglob("*.py") if name in p.read_text().replace('find_spec("triton")', "")]
        assert not hits, f"core names the plugin {name} in {hits}"
