"""Speculation where the engine is not a thread of the server: ``--engine-process`` and
``--tp-size 2`` (rank 0 drafts and verifies, the ranks run each forward together) answer what a
plain TP=1 server answers, greedy and seeded, on a tiny random Llama drafting for itself
(STANDALONE)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from server_utils import start_server, stop_server

pytestmark = pytest.mark.slow  # three servers, two of them multi-process

COMMON = ["--batch-storage", "none", "--enable-deterministic-inference", "--num-threads", "1"]
PROMPT = list(range(10, 18)) * 4  # token ids: the tiny model has 512, its tokenizer many more
SAMPLING = [{"temperature": 0}, {"temperature": 0.8, "seed": 9}]


def _answers(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    return [client.completions.create(model="m", prompt=PROMPT, max_tokens=24, **kw).choices[0].text for kw in SAMPLING]


def _drafts_counted(url: str) -> float:
    """The engine process publishes its counters twice a second: wait up to 5 s for a snapshot
    taken after the requests above."""
    deadline, drafts = time.monotonic() + 5, 0.0
    while time.monotonic() < deadline:
        metrics = httpx.get(url + "/metrics", timeout=10).text
        lines = [line for line in metrics.splitlines() if line.startswith("llmkit:spec_decode_num_drafts_total")]
        drafts = float(lines[0].split()[-1]) if lines else 0.0
        if drafts > 0:
            break
        time.sleep(0.1)
    return drafts


@pytest.fixture(scope="module")
def reference(tiny_llama):
    proc, url = start_server(["--model-path", str(tiny_llama), *COMMON])
    try:
        yield _answers(url)
    finally:
        stop_server(proc)


@pytest.mark.parametrize("where", [["--engine-process"], ["--tp-size", "2"]], ids=["engine-process", "tp2"])
def test_speculation_out_of_the_server_process(tiny_llama, reference, where):
    # the model drafting for itself: every step drafts (a lookup might find nothing in a random
    # model's output), greedy drafts are all kept, seeded ones partly
    spec = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(tiny_llama)]
    proc, url = start_server(["--model-path", str(tiny_llama), *COMMON, *spec, *where])
    try:
        assert _answers(url) == reference
        assert _drafts_counted(url) > 0
    finally:
        stop_server(proc)
