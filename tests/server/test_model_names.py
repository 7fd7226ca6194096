"""The names a model is served under: served name and aliases exactly, its Hugging Face id in any
letter case (as the hub resolves ids), not listed in /v1/models; anything else is a 404 naming them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fake_engine import fake_app

HF_ID = "Qwen/Qwen2.5-0.5B-Instruct"
SERVED = "Served: `fake-model`, `m`, `Qwen/Qwen2.5-0.5B-Instruct` (add names with --served-model-name)"


@pytest.fixture(scope="module")
def http():
    with TestClient(fake_app(hf_model_id=HF_ID)) as client:
        yield client


def _chat(http, model):
    return http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("model", ["fake-model", "m", HF_ID, "qwen/qwen2.5-0.5b-instruct"])
def test_served_names_and_hf_id_in_any_case_are_served(http, model):
    assert _chat(http, model).status_code == 200
    assert http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert http.get(f"/v1/models/{model}").json()["id"] == model


def test_models_lists_the_served_name_only(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["fake-model"]


@pytest.mark.parametrize("model", ["gpt-4o", "M", "Qwen/Qwen2.5-7B-Instruct"])  # aliases match exactly
def test_other_names_are_404_listing_the_served_ones(http, model):
    for r in (_chat(http, model), http.get(f"/v1/models/{model}")):
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert err["message"] == f"The model `{model}` does not exist. {SERVED}"


def test_hf_id_equal_to_the_served_name_is_listed_once():
    with TestClient(fake_app(hf_model_id="fake-model", served_model_aliases=())) as http:
        message = _chat(http, "x").json()["error"]["message"]
        assert message.endswith("Served: `fake-model` (add names with --served-model-name)")
