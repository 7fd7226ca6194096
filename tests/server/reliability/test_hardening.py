"""Issue 18's hardening, checked in-process on the real app over the FakeEngineClient: one error
shape for every route, one body cap enforced while reading, unknown models, requests that can
never fit, cheap prompt bounds, slow templates, exact-path auth exemptions, ignored fields."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from fake_engine import fake_app

OK_MSG = [{"role": "user", "content": "hi"}]


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def http():
    with TestClient(fake_app(max_payload_size=4096)) as client:
        yield client


# --- 3. every error in OpenAI's shape (Anthropic's on /v1/messages*) ---------------------------


def test_unknown_route_is_openai_shaped(http):
    err = _error(http.get("/v1/nope"), 404)
    assert err["code"] == "not_found" and "/v1/nope" in err["message"]


def test_wrong_method_is_openai_shaped(http):
    resp = http.get("/v1/chat/completions")
    err = _error(resp, 405)
    assert err["code"] == "method_not_allowed" and "POST" in resp.headers["allow"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/separate_reasoning", {"text": 1, "reasoning_parser": "qwen3"}, "text"),
        ("/separate_reasoning", {"text": "x"}, "reasoning_parser"),
        ("/parse_function_call", {"text": "x", "tool_call_parser": "hermes", "tools": 5}, "tools"),
    ],
)
def test_parser_routes_validation_is_400_openai_shaped(http, path, body, param):
    err = _error(http.post(path, json=body), 400)
    assert err["param"] == param


def test_query_validation_is_400_openai_shaped(http):
    err = _error(http.get("/v1/responses/resp_x/input_items", params={"limit": "many"}), 400)
    assert err["param"] == "limit"


def test_anthropic_routes_keep_anthropic_shape(http):
    resp = http.get("/v1/messages")  # POST-only route
    assert resp.status_code == 405
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"]


# --- 2. one body cap, every route, enforced while reading ------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/separate_reasoning",
        "/parse_function_call",
        "/v1/chat/completions",
        "/v1/completions",
        "/generate",
        "/tokenize",
        "/v1/nope",
    ],
)
def test_declared_large_body_is_413_unread(http, path):
    err = _error(http.post(path, content=b"x" * 5000, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "payload_too_large" and "4096" in err["message"]


@pytest.mark.parametrize("path", ["/separate_reasoning", "/parse_function_call", "/v1/chat/completions"])
def test_chunked_large_body_is_cut_off_while_reading(path):
    """Straight over ASGI, counting the chunks the app pulls: a body without Content-Length is
    refused once it passes the cap, not after it has all been read."""
    app = fake_app(max_payload_size=4096)
    pulled, sent = [], []

    async def receive():
        pulled.append(1)
        return {"type": "http.request", "body": b" " * 1024, "more_body": len(pulled) < 1000}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "payload_too_large"
    assert len(pulled) <= 5, len(pulled)  # stopped at 4 KB, not after 1 MB


def test_small_bodies_still_work(http):
    r = http.post("/separate_reasoning", json={"text": "<think>a</think>b", "reasoning_parser": "qwen3"})
    assert r.status_code == 200 and r.json() == {"reasoning_text": "a", "text": "b"}


# --- 4. a model the server does not serve is a 404 -------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": OK_MSG, "max_tokens": 2}),
        ("/v1/completions", {"model": "gpt-4o", "prompt": "hi", "max_tokens": 2}),
        ("/v1/responses", {"model": "gpt-4o", "input": "hi", "max_output_tokens": 2}),
    ],
)
def test_unknown_model_is_404(http, path, body):
    err = _error(http.post(path, json=body), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"] == (
        "The model `gpt-4o` does not exist. Served: `fake-model`, `m` (add names with --served-model-name)"
    )


def test_unknown_model_on_anthropic_route_is_anthropic_404(http):
    r = http.post("/v1/messages", json={"model": "claude-x", "max_tokens": 2, "messages": OK_MSG})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("model", ["fake-model", "m", None])
def test_served_name_aliases_and_no_model_are_served(http, model):
    body = {"messages": OK_MSG, "max_tokens": 2, **({"model": model} if model else {})}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert http.get(f"/v1/models/{model or 'fake-model'}").status_code == 200
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["fake-model"]


def test_served_model_name_repeats_into_aliases():
    import typer

    from llmkit.cli.serve import _serve_only_app
    from llmkit.cli.serve_options import build_configs

    cmd = typer.main.get_command(_serve_only_app())
    ctx = cmd.make_context(
        "serve", ["--served-model-name", "main", "--served-model-name", "alias1", "--served-model-name", "alias2"]
    )
    _, server = build_configs(ctx.params)
    assert server.served_model_name == "main" and server.served_model_aliases == ("alias1", "alias2")


def test_cost_cap_flags_reach_the_server_config():
    import typer

    from llmkit.cli.serve import _serve_only_app
    from llmkit.cli.serve_options import build_configs

    cmd = typer.main.get_command(_serve_only_app())
    ctx = cmd.make_context("serve", ["--max-system-blocks", "3", "--max-prompt-logprobs-tokens", "5"])
    _, server = build_configs(ctx.params)
    assert server.max_system_blocks == 3 and server.max_prompt_logprobs_tokens == 5
    with TestClient(fake_app(max_prompt_logprobs_tokens=5)) as client:
        body = {"model": "m", "prompt": "one two three four five six", "echo": True, "logprobs": 0, "max_tokens": 1}
        assert "--max-prompt-logprobs-tokens" in _error(client.post("/v1/completions", json=body), 400)["message"]


# --- 5. a request that can never fit is a 400; a full queue is a 429 with Retry-After --------


def test_request_larger_than_the_queue_is_400(http):
    body = {"model": "m", "prompt": ["hi"] * 256, "n": 16, "max_tokens": 1}
    err = _error(http.post("/v1/completions", json=body), 400)
    assert err["code"] == "request_too_large" and "4096" in err["message"] and "1024" in err["message"]


def test_full_queue_is_429_with_retry_after():
    app = fake_app()
    engine = app.state.llmkit.client
    with TestClient(app) as client:
        engine.active = engine.max_queued - 1  # as if 1,023 requests were in flight
        try:
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": OK_MSG, "n": 2, "max_tokens": 1})
        finally:
            engine.active = 0
        err = _error(r, 429)
        assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 0


# --- 1. a prompt that cannot fit is refused before the tokenizer runs -------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"model": "m", "prompt": "x" * (6 << 20), "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x" * (6 << 20)}]}),
    ],
)
def test_huge_prompt_is_rejected_cheaply(path, body):
    """Tokenizing 6 MB without spaces costs seconds of CPU; the character bound answers at once."""
    import time

    with TestClient(fake_app()) as client:
        t0 = time.monotonic()
        err = _error(client.post(path, json=body), 400)
        elapsed = time.monotonic() - t0
    assert err["code"] == "context_length_exceeded" and "context length (8192 tokens)" in err["message"]
    assert elapsed < 2.0, elapsed


def test_max_prompt_size_flag():
    with TestClient(fake_app(max_prompt_size=1000)) as client:
        err = _error(client.post("/v1/completions", json={"model": "m", "prompt": "hi " * 500, "max_tokens": 1}), 400)
        assert "--max-prompt-size" in err["message"] and err["param"] == "prompt"
        assert (
            client.post("/v1/completions", json={"model": "m", "prompt": "hi " * 300, "max_tokens": 1}).status_code
            == 200
        )


# --- 7. a template that runs into its deadline delays only its own request -------------------

SLOW = (
    "{% if 'slow' in messages[0]['content'] %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
)


def test_slow_template_does_not_stall_other_requests():
    """As many deadline-bound renders as asyncio's default executor has threads: a completion
    (tokenized on a thread) and a normal chat request still answer at once."""
    import os
    import time

    import httpx

    from llmkit.core.server.prompts.chat_template import ChatTemplate

    app = fake_app()
    tok = app.state.llmkit.tokenizer
    app.state.llmkit.chat_template = ChatTemplate(SLOW + tok.chat_template, tok.bos_token or "", tok.eos_token or "")
    n_slow = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor size

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:

            async def post(path, body, delay=0.0):
                await asyncio.sleep(delay)
                t0 = time.monotonic()
                r = await c.post(path, json=body)
                return r.status_code, time.monotonic() - t0

            slow = [
                post(
                    "/v1/chat/completions",
                    {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "slow"}]},
                )
                for _ in range(n_slow)
            ]
            fast = [
                post("/v1/completions", {"model": "m", "prompt": "word " * 1000, "max_tokens": 1}, 0.5),
                post("/v1/chat/completions", {"model": "m", "messages": OK_MSG, "max_tokens": 1}, 0.5),
            ]
            return await asyncio.gather(*slow, *fast)

    results = asyncio.run(main())
    assert all(code == 400 for code, _ in results[:n_slow])  # the deadline, 5 s
    for code, elapsed in results[n_slow:]:
        assert code == 200 and elapsed < 2.5, results[n_slow:]


# --- operator limits: exact-path auth exemptions; ignored fields ------------------------------


def test_only_health_is_open_by_exact_path():
    with TestClient(fake_app(api_keys=("sk-k",))) as client:
        assert client.get("/health").status_code == 200
        for path in ("/health_generate", "/healthz", "/health/x", "/metrics_x", "/ping", "/ping2"):
            err = _error(client.get(path), 401)
            assert err["type"] == "authentication_error", path
        assert client.get("/health_generate", headers={"Authorization": "Bearer sk-k"}).status_code == 200


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1, "best_of": 3}, "best_of"),
        ("/v1/chat/completions", {"model": "m", "messages": OK_MSG, "chat_template": "{{ 'x' }}"}, "chat_template"),
    ],
)
def test_fields_that_would_be_ignored_are_400(http, path, body, param):
    err = _error(http.post(path, json=body), 400)
    assert err["param"] == param


def test_best_of_equal_to_n_is_served(http):
    r = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1, "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# --- the default KV pool follows the context and --max-running-requests ----------------------


def test_default_kv_pool_is_sized_from_context_and_running_requests():
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.stages.sizing import cpu_pool_tokens as _pool_tokens

    bpt = 46080  # SmolLM2-135M in fp32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes
    assert _pool_tokens(EngineConfig(), bpt, 8192) * bpt < 2 << 30  # was 65,536 tokens = 3 GB
    assert _pool_tokens(EngineConfig(max_running_requests=64), bpt, 8192) == 32768
    assert _pool_tokens(EngineConfig(max_running_requests=4), bpt, 8192) == 16384  # two full contexts
    assert _pool_tokens(EngineConfig(max_running_requests=4096), bpt, 8192) <= 65536
    assert _pool_tokens(EngineConfig(max_total_tokens=1000), bpt, 8192) == 1000
