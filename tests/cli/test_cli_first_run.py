"""A new user's first run (issue 19): mistakes are one-line errors found before the model loads,
help shows whole flag names, SGLang's flag names are accepted, batch failures exit non-zero."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

from llmkit.cli.main import app


def _serve(*args: str):
    start = time.monotonic()
    res = CliRunner().invoke(app, ["serve", *args])
    return res, time.monotonic() - start


def _one_line_error(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Serving on" not in res.output


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--port", "99999"], ["--port 99999", "1 to 65535"]),
        (["--grammar-backend", "nope"], ["unknown grammar backend 'nope'", "xgrammar"]),
        (["--quantization", "int3"], ["unknown --quantization 'int3'", "int8", "int4"]),
        (["--quantization", "int4", "--quantization-group-size", "48"], ["--quantization-group-size 48", "128"]),
        (["--model-path", "x.gguf"], ["'x.gguf' does not exist"]),
        (["--reasoning-parser", "nope"], ["unknown reasoning parser 'nope'", "qwen3"]),
        (["--tool-call-parser", "nope"], ["unknown tool-call parser 'nope'", "hermes"]),
        (["--chat-template", "missing.jinja"], ["'missing.jinja' does not exist"]),
        (["--dtype", "fp8"], ["unknown --dtype 'fp8'"]),
        (["--device", "tpu"], ["unknown --device 'tpu'"]),
        (["--tp", "3", "--nnodes", "2"], ["--tp-size 3 must be a multiple of --nnodes 2"]),
        (["--tp-size", "1", "--trust-remote-code", "--mem-fraction-static", "1.5"], ["--mem-fraction-static 1.5"]),
        (["--enable-overlap-schedule", "--disable-overlap-schedule"], ["contradict"]),
        (["--skip-server-warmup", "--enable-server-warmup"], ["contradict"]),
        (["--page-size", "0"], ["--page-size must be at least 1 (got 0)"]),
        (["--log-level", "loud"], ["unknown --log-level 'loud'", "debug"]),
        (["--speculative-algorithm", "NGRAM", "--speculative-draft-device", "cpu"], ["has none of its own"]),
        (["--gateway-worker-url", "http://w:1"], ["give --gateway-url too"]),
        (["--dist-init-addr", "nohost"], ["--dist-init-addr 'nohost' must be HOST:PORT"]),
        (["--model-path", "all-MiniLM-L6-v2", "--tool-call-parser", "hermes"], ["--tool-call-parser applies"]),
        (["--generation-config", "/nowhere"], ["--generation-config /nowhere: no generation_config.json"]),
    ],
    ids=[
        "port-range",
        "grammar",
        "quantization",
        "quantization-group-size",
        "missing-gguf",
        "reasoning",
        "tool-parser",
        "template",
        "dtype",
        "device",
        "tp",
        "mem-fraction",
        "overlap-flags",
        "warmup-flags",
        "page-size",
        "log-level",
        "draft-device",
        "gateway-worker",
        "dist-addr",
        "embedding-generation-only",
        "generation-config",
    ],
)
def test_mistakes_fail_before_loading_in_one_line(args, needles):
    res, took = _serve(*args)
    _one_line_error(res, *needles)
    assert took < 20  # nothing was loaded
    if "contradict" not in res.stderr:  # two flags of one field: only a command line can say both
        assert _python_api_refusal(args) == res.stderr.strip().removeprefix("error: ")


def _python_api_refusal(args) -> str:
    """What ``build_server`` refuses the same options with (core/refusals.py, as the CLI uses)."""
    import typer

    from llmkit.cli.serve import _serve_only_app
    from llmkit.cli.serve_options import build_configs
    from llmkit.core.launch import build_server
    from llmkit.core.option import OptionError

    params = typer.main.get_command(_serve_only_app()).make_context("serve", list(args)).params
    with pytest.raises(OptionError) as err:
        build_server(*build_configs(params))
    return str(err.value)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A machine that reports one CUDA device, for the device-aware refusals (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_int4_is_served_on_a_gpu_and_int8_refused_by_both_fronts(fake_gpu, monkeypatch):
    """int4 has a Triton kernel on CUDA (the engine's plan and the docs say so); the CLI once
    refused it there. int8 and a GGUF's own blocks are CPU paths, refused alike by the CLI and by
    build_server."""
    import llmkit.cli.listen
    import llmkit.core.launch

    class Built(Exception):
        pass

    def build(checked):
        assert checked.device == "cuda" and checked.engine.quantization == "int4"
        raise Built

    monkeypatch.setattr(llmkit.cli.listen, "bind_socket", lambda host, port: None)
    monkeypatch.setattr(llmkit.core.launch, "build_checked_server", build)
    res, _ = _serve("--quantization", "int4", "--device", "cuda")
    assert isinstance(res.exception, Built), res.output  # past every check, on to the load
    res, _ = _serve("--quantization", "int8", "--device", "cuda")
    _one_line_error(res, "--quantization int8 is a CPU decode path", "int4")
    assert _python_api_refusal(["--quantization", "int8", "--device", "cuda"]) in res.stderr
    res, _ = _serve("--dp-size", "2")  # one GPU: two replicas need two
    _one_line_error(res, "--dp-size 2 needs 2 GPUs")
    assert _python_api_refusal(["--dp-size", "2"]) in res.stderr


def test_port_in_use_fails_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res, took = _serve("--port", str(port))
    _one_line_error(res, f"cannot listen on 127.0.0.1:{port}", "another --port")
    assert took < 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "serve", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "CUDA is not available" in proc.stderr and "--device cpu" in proc.stderr


def test_help_shows_whole_flag_names_when_piped():
    res = CliRunner().invoke(app, ["serve", "--help"], terminal_width=80)
    assert res.exit_code == 0
    out = res.output
    for flag in (
        "--enable-deterministic-inference",
        "--disable-overlap-schedule",
        "--mem-fraction-static",
        "--trust-remote-code",
        "--tp-size",
    ):
        assert flag in out, flag
    assert "…" not in out
    line = next(x for x in out.splitlines() if "--served-model-name" in x)
    assert "model id" in line


def test_grammar_backend_error_names_each_choice_once():
    res, _ = _serve("--grammar-backend", "nope")
    valid = res.stderr.split("valid: ", 1)[1].strip().split(", ")
    assert "none" in valid and len(valid) == len(set(valid)), res.stderr


def test_help_has_no_doubled_percent_or_typed_flags():
    """Flags take no value, so no "<bool>" after them (--help included); help text is not
    %-formatted, so "20%%" would show as written."""
    for cmd in ([], ["serve"], ["batch", "run"], ["plugins"], ["bench", "serve"]):
        out = CliRunner().invoke(app, [*cmd, "--help"], terminal_width=200).output
        assert "<bool>" not in out and "%%" not in out, (cmd, out)
        help_line = next(x for x in out.splitlines() if "--help" in x)
        assert help_line.split("--help", 1)[1].split()[0] == "Show", help_line
    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200).output
    assert "20% of RAM" in out and "<int>" in out  # valued options keep their type


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_only_attention_on_cpu_fails_before_loading():
    res, took = _serve("--attention", "flashinfer")
    _one_line_error(res, "--attention flashinfer", "needs a CUDA device", "torch")
    assert "pip install" not in res.stderr
    assert took < 20  # nothing was loaded


def test_mem_fraction_static_sizes_the_kv_pool():
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.stages.sizing import cpu_pool_tokens as _pool_tokens

    small = _pool_tokens(EngineConfig(mem_fraction_static=0.01), 1024, 8192, weight_bytes=1 << 20)
    large = _pool_tokens(EngineConfig(mem_fraction_static=0.02), 1024, 8192, weight_bytes=1 << 20)
    assert large - small == pytest.approx(small + 1024, rel=1e-3)  # linear in the fraction, weights off the top
    with pytest.raises(ValueError, match="too little memory"):
        _pool_tokens(EngineConfig(mem_fraction_static=0.01), 1024, 8192, weight_bytes=1 << 50)
    assert _pool_tokens(EngineConfig(mem_fraction_static=0.5, max_total_tokens=100), 1024, 8192) == 100


def test_gguf_conversion_gives_writable_tensors_without_warnings():
    import warnings

    from gguf import GGUFReader

    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_tensors
    from llmkit.core.model.loader.source import embedded_gguf_path

    reader = GGUFReader(str(embedded_gguf_path()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy "not writable" was a UserWarning at the first start
        for _, tensor in gguf_tensors(reader, gguf_config(reader)):
            tensor.add_(0)
