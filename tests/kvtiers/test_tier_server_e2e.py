"""The storage tier in real ``llmkit serve`` processes, talked to with the ``openai`` client: a
long prompt computed before a restart is loaded from the file tier after it (``cached_tokens``
says so, the text is the same); two replicas share prefixes through Redis; and with the Redis
server gone, requests still succeed at once."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from metrics_utils import parse_metrics, value
from server_utils import free_port, start_server, stop_server
from tier_utils import start_redis

# ~530 tokens of varied text (a document resent with each question)
DOC = " ".join(
    f"Clause {i}: the party of part {i % 7} shall deliver item {i * 13 % 101} by day {i % 28}." for i in range(24)
)
ARGS = ["--enable-hierarchical-cache", "--attention", "torch", "--page-size", "16", "--max-total-tokens", "4096"]


def _ask(base: str, prompt: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    out = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def _metrics(base: str) -> dict:
    return parse_metrics(httpx.get(base + "/metrics", timeout=30).text)


def _wait_written(base: str, blocks: int) -> None:
    deadline = time.monotonic() + 60
    while value(_metrics(base), "llmkit:kv_tier_write_blocks_total") < blocks:
        assert time.monotonic() < deadline, "the tier's writes never finished"
        time.sleep(0.1)


def test_a_restarted_server_loads_the_prefix_from_disk(tmp_path):
    args = [*ARGS, "--hicache-storage-path", str(tmp_path)]
    proc, base = start_server(args)
    try:
        text, cached = _ask(base, DOC)
        assert cached == 0
        _wait_written(base, 1)
    finally:
        stop_server(proc)  # (SIGTERM: the queued writes finish first)
    proc, base = start_server(args)
    try:
        again, cached = _ask(base, DOC)
        assert again == text
        assert cached >= 448  # every whole 64-token block of the prompt
        m = _metrics(base)
        assert value(m, "llmkit:prefix_cache_tier_hits_total", tier="storage") == cached
        assert value(m, "llmkit:prefix_cache_tier_bytes_total", tier="storage") > 0
        # every tier metric docs/observing.md names is exposed
        page = (Path(__file__).resolve().parents[2] / "docs" / "observing.md").read_text()
        documented = set(re.findall(r"`(llmkit:(?:kv_tier_|prefix_cache_tier_)[a-z0-9_]+)`", page))
        assert len(documented) == 8 and documented <= {name for name, _ in m}
    finally:
        stop_server(proc)


@pytest.fixture
def redis_url():
    port = free_port()
    proc = start_redis(port)
    yield proc, f'{{"url": "redis://127.0.0.1:{port}/0", "timeout": 1}}'
    proc.kill()
    proc.wait(10)


def test_replicas_share_prefixes_through_redis_and_serve_without_it(redis_url):
    redis, extra = redis_url
    args = [*ARGS, "--hicache-storage-backend", "redis", "--hicache-storage-backend-extra-config", extra]
    first, url1 = start_server(args)
    try:
        second, url2 = start_server(args)
        try:
            text, cached = _ask(url1, DOC)
            assert cached == 0
            _wait_written(url1, 1)
            other, cached = _ask(url2, DOC)
            assert other == text and cached >= 448
            redis.kill()
            redis.wait(10)
            t0 = time.monotonic()
            _, cached = _ask(url2, "A new question on a store that is gone. " + DOC[:500])
            assert cached == 0 and time.monotonic() - t0 < 30
            assert value(_metrics(url2), "llmkit:kv_tier_errors_total") >= 1
        finally:
            stop_server(second)
    finally:
        stop_server(first)
