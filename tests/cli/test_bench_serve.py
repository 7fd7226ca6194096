"""``llmkit bench serve`` (the real CLI, in a subprocess) against a real ``llmkit serve``: what it
reports agrees with the server's ``/metrics`` for the same run."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from metrics_utils import delta, parse_metrics
from server_utils import start_server, stop_server

M = "bench-model"


@pytest.fixture(scope="module")
def url():
    # Two queue slots, so a run with more in flight gets 429s (failed requests) to count; speculation
    # on, for the acceptance the report gives.
    args = ["--served-model-name", M, "--max-queued-requests", "2", "--batch-storage", "none"]
    proc, base = start_server([*args, "--speculative-algorithm", "NGRAM"])
    try:
        yield base
    finally:
        stop_server(proc)


def scrape(url: str) -> dict:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def bench(url: str, tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmkit.cli.main",
            "bench",
            "serve",
            "--base-url",
            url,
            "--json",
            str(out),
            "--no-progress",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads(out.read_text()), proc.stdout


def success(after, before) -> float:
    return sum(
        delta(after, before, "llmkit:request_success_total", model_name=M, finished_reason=r)
        for r in ("stop", "length", "abort")
    )


def test_random_chat_agrees_with_metrics(url, tmp_path):
    before = scrape(url)
    s, text = bench(
        url,
        tmp_path,
        "--backend",
        "openai-chat",
        "--num-prompts",
        "6",
        "--random-input-len",
        "24",
        "--random-output-len",
        "8",
        "--ignore-eos",
        "--max-concurrency",
        "2",
    )
    after = scrape(url)
    assert "Serving Benchmark Result" in text and "P99 TTFT (ms)" in text
    assert s["model"] == M  # found through /v1/models
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["total_output_tokens"] == 6 * 8  # --ignore-eos: exactly max_tokens each
    assert success(after, before) == 6
    assert s["total_input_tokens"] == delta(after, before, "llmkit:prompt_tokens_total", model_name=M)
    assert s["total_output_tokens"] == delta(after, before, "llmkit:generation_tokens_total", model_name=M)
    assert delta(after, before, "llmkit:e2e_request_latency_seconds_count", model_name=M) == 6
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < s[f"median_{key}_ms"] <= s[f"p99_{key}_ms"], key
    assert s["mean_ttft_ms"] < s["mean_e2el_ms"]
    assert s["output_throughput"] > 0 and s["request_throughput"] > 0
    steps = delta(after, before, "llmkit:spec_decode_num_drafts_total", model_name=M)
    accepted = delta(after, before, "llmkit:spec_decode_num_accepted_tokens_total", model_name=M)
    assert "Accept length:" in text
    assert s["spec_accept_length"] == pytest.approx((accepted + steps) / steps if steps else 0.0)


def test_jsonl_completions_count_429s_as_failures(url, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {i}:", "max_tokens": 24}) for i in range(4)) + "\n")
    before = scrape(url)
    # four at once on a server that holds two: the two that find it full get 429
    s, _ = bench(
        url,
        tmp_path,
        "--backend",
        "openai-completions",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "8",
        "--ignore-eos",
        "--max-concurrency",
        "4",
        "--request-rate",
        "inf",
    )
    after = scrape(url)
    assert s["completed"] + s["failed"] == 8
    assert s["failed"] >= 1 and all("429" in e for e in s["errors"])
    assert s["failed"] == delta(after, before, "llmkit:request_rejected_total", model_name=M)
    assert s["completed"] == success(after, before)
    assert s["total_output_tokens"] == 24 * s["completed"]
    assert s["total_input_tokens"] == delta(after, before, "llmkit:prompt_tokens_total", model_name=M)
    assert s["total_output_tokens"] == delta(after, before, "llmkit:generation_tokens_total", model_name=M)


def test_poisson_rate(url, tmp_path):
    before = scrape(url)
    s, _ = bench(
        url,
        tmp_path,
        "--backend",
        "openai-completions",
        "--num-prompts",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--request-rate",
        "20",
        "--max-concurrency",
        "1",
    )
    after = scrape(url)
    assert s["request_rate"] == 20 and s["completed"] == 4
    assert s["total_output_tokens"] == delta(after, before, "llmkit:generation_tokens_total", model_name=M)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "nope"], "openai-chat"),
        (["--request-rate", "0"], "must be > 0"),
    ],
)
def test_bad_options_exit_2(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "bench", "serve", "--base-url", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr + proc.stdout
