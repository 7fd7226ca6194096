"""Every generating route passes the adapter a request names (by ``model``, or SGLang's
``lora_path``) to the engine, in-process over the fake engine; the load routes need an admin key."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fake_engine import fake_app

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def app():
    app = fake_app()
    app.state.llmkit.loras["sql"] = "/adapters/sql"
    return app


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        ("/v1/messages", {"messages": MSG, "max_tokens": 2}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    ],
)
def test_every_route_generates_with_the_named_adapter(app, path, body):
    engine = app.state.llmkit.client
    with TestClient(app) as http:
        for model, expected in (("sql", "sql"), ("fake-model", None)):
            r = http.post(path, json={**body, "model": model})
            assert r.status_code == 200, r.text
            assert engine.submitted[-1].lora == expected
        r = http.post(path, json={**body, "model": "nope"})
        assert r.status_code == 404
        if path not in ("/v1/messages", "/v1/responses"):  # their bodies refuse unknown fields
            assert http.post(path, json={**body, "lora_path": "sql"}).status_code == 200
            assert engine.submitted[-1].lora == "sql"
            assert http.post(path, json={**body, "lora_path": "nope"}).status_code == 404


def test_loading_needs_an_admin_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-user alice\nsk-ops ops admin\n")
    with TestClient(fake_app(api_keys_file=str(keys))) as http:
        body = {"lora_name": "x", "lora_path": "/nowhere"}
        r = http.post("/load_lora_adapter", json=body, headers={"Authorization": "Bearer sk-user"})
        assert r.status_code == 403
        r = http.post("/unload_lora_adapter", json={"lora_name": "x"}, headers={"Authorization": "Bearer sk-user"})
        assert r.status_code == 403
        r = http.post("/unload_lora_adapter", json={"lora_name": "x"}, headers={"Authorization": "Bearer sk-ops"})
        assert r.status_code == 404  # an admin gets through: nothing named x is loaded
        r = http.post("/load_lora_adapter", json={"lora_name": "x"}, headers={"Authorization": "Bearer sk-ops"})
        assert r.status_code == 400 and "lora_path" in r.text
