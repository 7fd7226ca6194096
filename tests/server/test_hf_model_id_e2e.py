"""A real ``llmkit serve`` answers to the model's Hugging Face id, as SGLang's notebooks send it
(``model="qwen/qwen2.5-0.5b-instruct"``), with the model in a hub cache's layout; other names are 404."""

from __future__ import annotations

import httpx
import pytest

from model_utils import tiny_model_dir
from server_utils import start_server, stop_server


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory):
    snapshot = tmp_path_factory.mktemp("hub") / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    tiny_model_dir(snapshot, "qwen2")
    proc, url = start_server(
        ["--model-path", str(snapshot), "--served-model-name", "tiny", "--batch-storage", "none", "--disable-web-ui"]
    )
    try:
        yield httpx.Client(base_url=url, timeout=120)
    finally:
        stop_server(proc)


def _complete(http, model):
    return http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})


@pytest.mark.parametrize("model", ["qwen/qwen2.5-0.5b-instruct", "Qwen/Qwen2.5-0.5B-Instruct", "tiny"])
def test_hub_cache_model_answers_to_its_id(hub_server, model):
    r = _complete(hub_server, model)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None


def test_unknown_model_is_404_naming_the_served_ones(hub_server):
    r = _complete(hub_server, "meta-llama/Meta-Llama-3.1-8B-Instruct")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `meta-llama/Meta-Llama-3.1-8B-Instruct` does not exist. "
        "Served: `tiny`, `Qwen/Qwen2.5-0.5B-Instruct` (add names with --served-model-name)",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert [m["id"] for m in hub_server.get("/v1/models").json()["data"]] == ["tiny"]


def test_embedded_model_answers_to_its_hf_id(server):
    r = server.client.completions.create(model="HuggingFaceTB/SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert r.choices[0].text is not None
