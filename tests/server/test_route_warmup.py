"""The server warms its routes up before /health answers (on CUDA by default; forced here on CPU)."""

from __future__ import annotations

import re

import openai

from server_utils import server_log, start_server, stop_server


def test_routes_warm_up_before_health_and_the_server_then_serves():
    proc, url = start_server(["--enable-server-warmup", "--api-key", "sk-warm"])
    try:
        log = server_log(proc)
        assert re.search(r"Warm-up: 6 requests", log)  # the engine's, first
        m = re.search(r"Route warm-up: 4 requests \(HTTP \[([0-9, ]+)\]\)", log)
        assert m, log
        # with the key the routes themselves ran: completions 200 (the embedded model has a chat template)
        assert m.group(1).split(", ") == ["200", "200", "200", "200"]
        assert "llmkit-warmup" not in log  # no request log lines from the warm-up's own client
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-warm", max_retries=0)
        out = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
    finally:
        stop_server(proc)
