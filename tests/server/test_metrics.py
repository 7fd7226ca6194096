"""``/metrics`` on the real app over the FakeEngineClient: names, counts, auth and switches.

The end-to-end count check on the real engine (abort and queue time included) is in
test_metrics_e2e.py."""

from __future__ import annotations

import pytest

from fake_engine import fake_app
from metrics_utils import parse_metrics, value

M = "fake-model"
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
]
COUNTERS = [
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "request_aborted_total",
    "request_rejected_total",
]


def _client(**config):
    from fastapi.testclient import TestClient

    return TestClient(fake_app(**config))


def _scrape(client, **headers) -> dict:
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.text)


def test_counts_follow_the_workload():
    with _client() as client:
        fake = client.app.state.llmkit.client
        fake.max_queued = 2
        prompt, done = 0, 0
        for max_tokens in (3, 5):
            r = client.post("/v1/completions", json={"model": M, "prompt": "Hello there", "max_tokens": max_tokens})
            assert r.status_code == 200, r.text
            prompt += r.json()["usage"]["prompt_tokens"]
            done += r.json()["usage"]["completion_tokens"]
        r = client.post(
            "/v1/chat/completions",
            json={"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2},
        )
        assert r.status_code == 200, r.text
        prompt += 2 * r.json()["usage"]["prompt_tokens"]  # n=2: two engine requests on one prompt
        done += r.json()["usage"]["completion_tokens"]
        fake.active += 1  # one slot held by "another request": n=2 does not fit now, one 429
        r = client.post("/v1/completions", json={"model": M, "prompt": "x", "max_tokens": 2, "n": 2})
        assert r.status_code == 429
        fake.active -= 1
        s = _scrape(client)
    assert done == 3 + 5 + 8
    assert value(s, "llmkit:prompt_tokens_total", model_name=M) == prompt
    assert value(s, "llmkit:generation_tokens_total", model_name=M) == done
    assert value(s, "llmkit:request_success_total", model_name=M, finished_reason="length") == 4
    assert value(s, "llmkit:request_success_total", model_name=M, finished_reason="abort") == 0
    assert value(s, "llmkit:request_rejected_total", model_name=M) == 1
    assert value(s, "llmkit:e2e_request_latency_seconds_count", model_name=M) == 4
    assert value(s, "llmkit:time_to_first_token_seconds_count", model_name=M) == 4
    # each request's outputs after its first are inter-token gaps
    assert value(s, "llmkit:inter_token_latency_seconds_count", model_name=M) == done - 4
    assert value(s, "llmkit:request_generation_tokens_sum", model_name=M) == done
    # live engine counters come through EngineClient.stats()
    assert value(s, "llmkit:num_requests_running", model_name=M) == 0


def test_every_documented_metric_is_exposed():
    with _client() as client:
        client.post("/v1/completions", json={"model": M, "prompt": "Hi", "max_tokens": 2})
        names = {n for n, _ in _scrape(client)}
    for h in HISTOGRAMS:
        assert f"llmkit:{h}_bucket" in names, h
    for c in COUNTERS:
        assert f"llmkit:{c}" in names, c


@pytest.mark.parametrize("no_auth", [False, True])
def test_metrics_need_the_key_unless_metrics_no_auth(no_auth):
    with _client(api_keys=("sekret",), metrics_no_auth=no_auth) as client:
        r = client.get("/metrics")
        assert r.status_code == (200 if no_auth else 401)
        assert client.get("/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        # the key still guards the API
        assert client.get("/v1/models").status_code == 401


def test_disable_metrics():
    with _client(enable_metrics=False) as client:
        assert client.get("/metrics").status_code == 404
        r = client.post("/v1/completions", json={"model": M, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], (True, False, True)),
        (["--disable-metrics", "--metrics-no-auth", "--disable-web-ui"], (False, True, False)),
    ],
)
def test_serve_flags_reach_the_server_config(args, expected):
    import typer

    from llmkit.cli.serve import _serve_only_app
    from llmkit.cli.serve_options import build_configs

    ctx = typer.main.get_command(_serve_only_app()).make_context("serve", args)
    _, server = build_configs(ctx.params)
    assert (server.enable_metrics, server.metrics_no_auth, server.enable_web_ui) == expected
