"""A text whose tokens the model has no rows for (a tokenizer bigger than the model's vocabulary)
is a 400 (on the routes that take text without a chat template: the tiny model has none), not the engine's refusal as a 500."""

from __future__ import annotations

import httpx
import pytest

from server_utils import start_server, stop_server


@pytest.fixture(scope="module")
def url(tiny_llama):  # 512 tokens, with the embedded model's 49,152-token tokenizer
    proc, url = start_server(["--model-path", str(tiny_llama), "--batch-storage", "none"])
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": "m", "prompt": "hello world", "max_tokens": 2}),
        ("/v1/completions", {"model": "m", "prompt": ["fine", "hello world"], "max_tokens": 2}),
        ("/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 2}}),
    ],
)
def test_text_outside_the_vocabulary_is_a_400(url, path, body):
    resp = httpx.post(url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "outside the model's vocabulary" in resp.text
    ok = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [10, 11, 12], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
