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


BAD_NAMES = {
    "NUL": "sql\0x",
    "slash": "team/sql",
    "backslash": "team\\sql",
    "dot-dot": "..",
    "hidden": ".sql",
    "10 KB": "n" * 10_000,
}


@pytest.mark.parametrize("name", BAD_NAMES.values(), ids=BAD_NAMES.keys())
def test_adapter_names_are_one_plain_path_segment(name):
    """Names are held to what a --lora-dir lookup takes; nothing reaches the engine."""
    app = fake_app()
    with TestClient(app) as http:
        r = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": "/adapters/sql"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "lora_name" and "at most 255 characters" in error["message"]
        assert len(error["message"]) < 1000
        assert not getattr(app.state.llmkit.client, "lora_loads", [])
        r = http.post("/load_lora_adapter", json={"lora_name": "sql-v2.1_b", "lora_path": "/adapters/sql"})
        assert r.status_code == 200, r.text


def test_adapter_paths_beyond_path_max_are_400():
    with TestClient(fake_app()) as http:
        for path in ("/a" * 3000, "/adapters/sql\0"):
            r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
            assert len(r.json()["error"]["message"]) < 1000


def test_a_non_admin_is_listed_only_the_adapters_it_was_given(tmp_path):
    """Adapters given at start or by an admin are listed to every caller; those the resolver
    loaded because some caller named them only to admins (any caller may still name one)."""

    class Shelf:  # a resolver with nothing more on it
        def fetch(self, name):
            return None

    keys = tmp_path / "keys"
    keys.write_text("sk-user alice\nsk-ops ops admin\n")
    app = fake_app(api_keys_file=str(keys))
    state = app.state.llmkit
    state.loras.update({"sql": "/adapters/sql", "tenant-b": "/lora-dir/tenant-b"})
    state.resolved_loras.add("tenant-b")
    state.lora_resolver = Shelf()
    user, admin = ({"Authorization": f"Bearer {k}"} for k in ("sk-user", "sk-ops"))
    body = {"prompt": "hi", "max_tokens": 2}
    with TestClient(app) as http:
        for headers, seen in ((user, {"sql"}), (admin, {"sql", "tenant-b"})):
            for extra in ({"model": "nope"}, {"lora_path": "nope"}):
                r = http.post("/v1/completions", json={**body, **extra}, headers=headers)
                assert r.status_code == 404, r.text
                message = r.json()["error"]["message"]
                assert {n for n in ("sql", "tenant-b") if f"`{n}`" in message} == seen, message
            models = http.get("/v1/models", headers=headers).json()["data"]
            assert {m["id"] for m in models} - {"fake-model"} == seen
        r = http.post("/v1/completions", json={**body, "model": "tenant-b"}, headers=user)
        assert r.status_code == 200 and state.client.submitted[-1].lora == "tenant-b"  # named, it serves
        r = http.post("/v1/completions", json={**body, "model": "n" * 10_000}, headers=user)
        assert r.status_code == 404 and len(r.json()["error"]["message"]) < 1000  # the name is not echoed whole
