"""``/metrics`` of a real ``llmkit serve`` after a known workload equals what the workload did:
requests by finish reason, prompt and completion tokens, one 429, one abort (a client that
closes its stream), and the engine's own counters (prefix-cache lookups, running, waiting)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from metrics_utils import parse_metrics, value
from server_utils import start_server, stop_server

M = "metrics-model"
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "llmkit-dashboard.json"
# the docs page that lists the metrics (docs/observing.md, "Prometheus metrics")
METRICS_PAGE = ROOT / "docs" / "observing.md"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # Two queue slots: a request with n=2 while another runs is refused with 429. Batches
    # stay on (in a temporary directory) for the batch-line gauges; speculation on for its
    # counters (it changes no output, so every count below holds as without it).
    storage = tmp_path_factory.mktemp("storage")
    args = ["--served-model-name", M, "--max-queued-requests", "2", "--file-storage-path", str(storage)]
    proc, base = start_server([*args, "--speculative-algorithm", "NGRAM"])
    try:
        yield base
    finally:
        stop_server(proc)


def scrape(url: str) -> dict:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def test_counters_equal_the_workload(url):
    http = httpx.Client(base_url=url, timeout=300)
    prompt = completion = 0
    chat = {"model": M, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
    for _ in range(2):  # the same prompt twice: the second finds it in the prefix cache
        usage = http.post("/v1/chat/completions", json=chat).json()["usage"]
        prompt, completion = prompt + usage["prompt_tokens"], completion + usage["completion_tokens"]
    with http.stream(
        "POST",
        "/v1/completions",
        json={
            "model": M,
            "prompt": [1, 2, 3, 4, 5, 6],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"completion_tokens": 5' in lines[-1]
    prompt, completion = prompt + 6, completion + 5

    # The abort: a long answer whose client leaves after 3 chunks; while it holds a slot, a
    # request with n=2 does not fit the two slots now (429, retry later).
    abort_max = 400
    with http.stream(
        "POST",
        "/v1/completions",
        json={
            "model": M,
            "prompt": list(range(100, 110)),
            "max_tokens": abort_max,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        got = 0
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            got += 1
            if got == 1:
                full = http.post("/v1/completions", json={"model": M, "prompt": "x", "max_tokens": 2, "n": 2})
                assert full.status_code == 429, full.text
            if got == 3:
                break
    deadline = time.monotonic() + 60
    # The server counts the abort when the stream closes; the engine frees the request just after.
    while (s := scrape(url)) and (
        value(s, "llmkit:request_aborted_total", model_name=M) < 1
        or value(s, "llmkit:num_requests_running", model_name=M) > 0
    ):
        assert time.monotonic() < deadline, "the abort never reached /metrics"
        time.sleep(0.2)
    prompt += 10

    assert (
        value(s, "llmkit:request_success_total", model_name=M, finished_reason="stop")
        + value(s, "llmkit:request_success_total", model_name=M, finished_reason="length")
        == 3
    )
    assert value(s, "llmkit:request_success_total", model_name=M, finished_reason="abort") == 1
    assert value(s, "llmkit:request_aborted_total", model_name=M) == 1
    assert value(s, "llmkit:request_rejected_total", model_name=M) == 1
    assert value(s, "llmkit:prompt_tokens_total", model_name=M) == prompt
    # the aborted request generated at least the 3 tokens streamed, and stopped well short of its max
    aborted_tokens = value(s, "llmkit:generation_tokens_total", model_name=M) - completion
    assert 3 <= aborted_tokens < abort_max
    assert value(s, "llmkit:e2e_request_latency_seconds_count", model_name=M) == 4
    assert value(s, "llmkit:time_to_first_token_seconds_count", model_name=M) == 4
    assert value(s, "llmkit:request_queue_time_seconds_count", model_name=M) == 4  # the engine's own timing
    # Engine-side counters, read through EngineClient.stats(): every prompt token was looked up in
    # the prefix cache once, the repeated chat prompt was found there, and nothing is left running.
    assert value(s, "llmkit:prefix_cache_queries_total", model_name=M) == prompt
    assert value(s, "llmkit:prefix_cache_hits_total", model_name=M) > 0
    assert 0 < value(s, "llmkit:prefix_cache_hit_rate", model_name=M) < 1
    assert value(s, "llmkit:num_requests_running", model_name=M) == 0
    assert value(s, "llmkit:num_requests_waiting", model_name=M) == 0
    assert value(s, "llmkit:num_preemptions_total", model_name=M) == 0
    assert 0 <= value(s, "llmkit:kv_cache_usage_perc", model_name=M) <= 1


def test_dashboard_and_docs_name_only_exposed_metrics(url):
    exposed = {name for name, _ in scrape(url)}
    dashboard = json.dumps(json.loads(DASHBOARD.read_text()))  # valid JSON
    plotted = set(re.findall(r"llmkit:[a-z0-9_]+", dashboard))
    documented = set(re.findall(r"`(llmkit:[a-z0-9_]+)`", METRICS_PAGE.read_text()))
    assert len(plotted) > 20 and len(documented) > 15
    assert plotted - exposed == set()
    # the docs page names histograms without their _bucket/_sum/_count series; the state-cache
    # gauges exist for hybrid models only (tests/model/test_qwen3_5.py scrapes them from one)
    hybrid_only = {n for n in documented if n.startswith("llmkit:state_")}
    assert hybrid_only
    # the storage tier's exist with --enable-hierarchical-cache (tests/kvtiers/test_tier_server_e2e.py)
    tier_only = {n for n in documented if n.startswith(("llmkit:kv_tier_", "llmkit:prefix_cache_tier_"))}
    assert tier_only
    others = documented - hybrid_only - tier_only
    assert {n for n in others if n not in exposed and n + "_count" not in exposed} == set()
    assert {"llmkit:batch_lines_in_flight", "llmkit:batch_lines_queued"} <= exposed
