"""A CPU install goes without triton (an extra): ``llmkit`` and ``llmkit serve`` work without it,
and only a Triton path asks for it, in one line naming the extra.

A fresh venv without torch's site packages is too slow to build here, so triton is made missing
instead: a ``triton`` package that raises ImportError comes first on PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from server_utils import free_port, server_log, start_server, stop_server


@pytest.fixture(scope="module")
def no_triton(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("no-triton")
    (root / "triton").mkdir()
    (root / "triton" / "__init__.py").write_text("raise ImportError(\"No module named 'triton' (simulated)\")\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _llmkit(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmkit.cli.main", *args]
    return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_help_without_triton(no_triton):
    out = _llmkit(["--help"], no_triton)
    assert out.returncode == 0 and "serve" in out.stdout, out.stderr


def test_serve_on_cpu_without_triton(no_triton):
    # --attention auto: on CPU the registry ranks torch only, and nothing imports triton
    args = ["--device", "cpu", "--max-total-tokens", "1024", "--batch-storage", "none", "--disable-web-ui"]
    proc, url = start_server(args, env=no_triton)
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
        assert "attention torch" in server_log(proc, tail=100_000)
    finally:
        stop_server(proc)


def test_attention_triton_without_triton_names_the_extra(no_triton):
    # the interpreter opt-in gets past the device check to the import (on CUDA it is the same)
    args = ["serve", "--attention", "triton", "--port", str(free_port())]
    out = _llmkit(args, {**no_triton, "LLMKIT_TRITON_INTERPRET": "1"})
    assert out.returncode != 0
    assert "Traceback" not in out.stderr + out.stdout
    assert "needs the 'triton' package" in out.stderr and "pip install 'llmkit[triton]'" in out.stderr
