"""Authentication, backpressure, payload caps, context-length flags, start-up errors and SIGTERM
drain, each on a server started with the flags under test."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from server_utils import free_port, server_log, start_server, stop_server

KEY = "sk-test-123456"


@pytest.fixture(scope="module")
def limited():
    proc, url = start_server(
        [
            "--api-key",
            KEY,
            "--max-queued-requests",
            "2",
            "--max-running-requests",
            "1",
            "--context-length",
            "1000",
            "--max-payload-size",
            "8192",
        ]
    )
    try:
        yield url
    finally:
        stop_server(proc)


def test_every_route_needs_the_key(limited):
    paths = httpx.get(limited + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
    assert "/v1/chat/completions" in paths
    for path, methods in paths.items():
        if path == "/health":  # the only open route (by exact path)
            continue
        concrete = path.replace("{model_id}", "x").replace("{file_id}", "file-x").replace("{batch_id}", "batch_x")
        for method in methods:
            for header in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Bearer"},
                {"Authorization": "Bearer " + "k" * 10_000},
            ):
                r = httpx.request(method.upper(), limited + concrete, headers=header, timeout=30)
                assert r.status_code == 401, (method, path, header.keys(), r.status_code)
                assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(limited + "/health").status_code == 200


def test_client_with_key_works(limited):
    client = openai.OpenAI(base_url=limited + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited + "/v1", api_key="nope", max_retries=0).models.list()


def test_full_queue_answers_429(limited):
    async def run():
        client = openai.AsyncOpenAI(base_url=limited + "/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one():
            try:
                await client.completions.create(
                    model="m", prompt="Once upon a time", max_tokens=40, extra_body={"ignore_eos": True}
                )
                return 200
            except openai.RateLimitError:
                return 429

        return await asyncio.gather(*(one() for _ in range(8)))

    codes = asyncio.run(run())
    assert codes.count(429) >= 1 and codes.count(200) >= 1, codes


def test_context_length_flag(limited):
    client = openai.OpenAI(base_url=limited + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="is longer than the model's context length"):
        client.completions.create(model="m", prompt="word " * 1200, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="Requested token count exceeds"):
        client.completions.create(model="m", prompt="hello", max_tokens=1200)


def test_payload_too_large(limited):
    r = httpx.post(
        limited + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "m", "prompt": "x" * 20_000, "max_tokens": 1},
    )
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("Payload Too Large")


def test_unknown_attention_backend_fails_at_startup():
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "serve", "--port", str(port), "--attention", "nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "nonexistent" in out.stderr and "torch" in out.stderr


def test_unknown_reasoning_parser_fails_at_startup():
    out = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "serve", "--port", str(free_port()), "--reasoning-parser", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "qwen3" in out.stderr


def test_sigterm_drains_in_flight_requests():
    proc, url = start_server(["--batch-storage", "none"])
    result = {}

    def long_request():
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(
            model="m", prompt="Once upon a time", max_tokens=60, extra_body={"ignore_eos": True}
        )
        result["tokens"] = r.usage.completion_tokens
        result["finish"] = r.choices[0].finish_reason

    t = threading.Thread(target=long_request)
    t.start()
    try:
        import time

        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert result == {"tokens": 60, "finish": "length"}, server_log(proc)
        # uvicorn re-raises the signal after its graceful shutdown, so -SIGTERM is a clean exit too
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        stop_server(proc)
