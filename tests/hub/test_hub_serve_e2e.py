"""``llmkit serve --model-path org/name`` (and ``org/repo:QUANT``) with the model only in a hub
cache laid out on disk under a temporary HF_HOME, offline: it serves under its id; a missing id
stops the start with a message naming where it looked."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from llmkit.core.model.loader.source import embedded_gguf_path

from hub_utils import hub_cache, hub_snapshot, link_into_snapshot, move_into_blobs
from model_utils import tiny_model_dir
from server_utils import start_server, stop_server


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    move_into_blobs(tiny_model_dir(hub_snapshot(home, "acme/tiny-llama"), "llama"))
    link_into_snapshot(hub_snapshot(home, "acme/SmolLM2-GGUF"), embedded_gguf_path(), "smollm2.Q4_1.gguf")
    return home


def _env(home):
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("model_id", ["acme/tiny-llama", "acme/SmolLM2-GGUF:Q4_1"])
def test_a_model_served_by_its_hub_id(hf_home, model_id):
    proc, url = start_server(
        ["--model-path", model_id, "--batch-storage", "none", "--disable-web-ui"], env=_env(hf_home)
    )
    try:
        http = httpx.Client(base_url=url, timeout=120)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [model_id]
        body = {"model": model_id, "prompt": "Hi", "max_tokens": 3, "temperature": 0}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        stop_server(proc)


def test_a_missing_id_is_a_clear_start_up_error(hf_home):
    cmd = [sys.executable, "-m", "llmkit.cli.main", "serve", "--model-path", "acme/absent", "--port", "0"]

    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **_env(hf_home)})
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "--model-path 'acme/absent' was not found" in out and str(hub_cache(hf_home)) in out, out
    assert "Traceback" not in out
