"""Issue 52's hostile-input probe, on a real ``llmkit serve`` of the packaged all-MiniLM-L6-v2: one
client's large request does not stall another's small one, a gone client's work is dropped, the
inputs held at once are bounded (429 + Retry-After), and tokens per minute count embedded tokens.

Times are compared with each other inside a test (ratios), never with a fixed number of seconds."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
import torch

from llmkit.core.model.loader.embedded_encoder import ENCODER_NAME

OPEN, TIGHT, TIGHT_SCORE = "sk-open-key", "sk-tight-key", "sk-tight-score-key"
QUEUE = 1024  # --max-queued-embedding-inputs: two large requests fill it
LARGE = 512  # inputs of a large request (--max-embedding-inputs)
# 80 tokens: a large request is ~41k tokens, some 10 forwards of the worker's 4,096-token budget
SENTENCE = " ".join(["the quick brown fox jumps over the lazy dog near the river bank"] * 6)
SMALL = ["Paris is the capital of France.", "a", "Embeddings for everyone, on a busy server."]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from tests.conftest import _server

    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{OPEN} open\n{TIGHT} tight tpm=300\n{TIGHT_SCORE} tightscore tpm=300\n")
    args = ["--model-path", ENCODER_NAME, "--api-keys-file", str(keys)]
    args += ["--max-embedding-inputs", str(LARGE), "--max-queued-embedding-inputs", str(QUEUE)]
    for server in _server(args):
        server.api_key = OPEN
        yield server


def _auth(key: str = OPEN) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _stats(srv) -> dict:
    return httpx.get(srv.base_url + "/get_server_info", headers=_auth(), timeout=30).json()


def _wait(srv, ready, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(srv)
        if ready(stats):
            return stats
        time.sleep(0.02)
    raise AssertionError(f"the server did not get there in {timeout} s: {stats}")


def _embed(srv, texts) -> tuple[torch.Tensor, float]:
    start = time.monotonic()
    resp = srv.client.embeddings.create(model="m", input=texts)
    return torch.tensor([d.embedding for d in resp.data]), time.monotonic() - start


@pytest.fixture(scope="module")
def large_alone(srv) -> float:
    """Seconds a large request takes on its own (the warm-up request first)."""
    _embed(srv, SMALL)
    return _embed(srv, [SENTENCE] * LARGE)[1]


def test_a_small_request_is_not_queued_behind_another_clients_large_one(srv, large_alone):
    alone, _ = _embed(srv, SMALL)
    done = {}
    big = threading.Thread(target=lambda: done.update(large=_embed(srv, [SENTENCE] * LARGE)[1]))
    embedded = _stats(srv)["num_embedded_inputs"]
    big.start()
    _wait(srv, lambda s: s["num_embedded_inputs"] > embedded)  # its forwards have begun
    beside, small_s = _embed(srv, SMALL)
    big.join(timeout=300)
    # In arrival order the small one waited for nearly all of the large one (50 s behind 256
    # inputs in the probe); it now shares the next forward.
    assert small_s < 0.4 * done["large"], (small_s, done["large"], large_alone)
    # batched with another request's inputs or alone, the same vectors (padding is masked)
    assert torch.allclose(beside, alone, atol=2e-6, rtol=0), (beside - alone).abs().max()


async def _abandoned(srv) -> None:
    """A client that sends a large request and goes away once its first forward has begun."""
    async with httpx.AsyncClient(base_url=srv.base_url, headers=_auth(), timeout=300) as http:
        embedded = (await http.get("/get_server_info")).json()["num_embedded_inputs"]
        task = asyncio.ensure_future(http.post("/v1/embeddings", json={"model": "m", "input": [SENTENCE] * LARGE}))
        while (await http.get("/get_server_info")).json()["num_embedded_inputs"] == embedded:
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_work_of_a_client_that_went_away_is_dropped(srv, large_alone):
    before = _stats(srv)
    asyncio.run(_abandoned(srv))
    gone = time.monotonic()
    stats = _wait(srv, lambda s: s["num_waiting_inputs"] == 0)
    idle_after = time.monotonic() - gone
    # The probe waited 62 s behind one abandoned request; its inputs are now dropped once the
    # server sees the client gone, and the server is idle within about a forward.
    assert idle_after < 0.4 * large_alone, (idle_after, large_alone)
    assert stats["num_dropped_inputs"] - before["num_dropped_inputs"] > LARGE // 2
    _, small_s = _embed(srv, SMALL)
    assert small_s < 0.4 * large_alone


async def _fill_queue_then(srv) -> tuple[httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(base_url=srv.base_url, headers=_auth(), timeout=300) as http:
        body = {"model": "m", "input": [SENTENCE] * LARGE}
        holders = [asyncio.ensure_future(http.post("/v1/embeddings", json=body)) for _ in range(QUEUE // LARGE)]
        try:
            while _stats(srv)["num_waiting_inputs"] <= LARGE:  # both taken in
                await asyncio.sleep(0.02)
            embeddings = await http.post("/v1/embeddings", json={"model": "m", "input": "one more"})
            score = await http.post("/v1/score", json={"model": "m", "text_1": "a", "text_2": "b"})
            return embeddings, score
        finally:
            for task in holders:  # gone clients: their work is dropped
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)


def test_inputs_held_at_once_are_bounded_with_429_and_retry_after(srv):
    embeddings, score = asyncio.run(_fill_queue_then(srv))
    for resp in (embeddings, score):
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["Retry-After"]) >= 1
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
        assert "--max-queued-embedding-inputs" in error["message"]
    _wait(srv, lambda s: s["num_waiting_inputs"] == 0)
    assert len(_embed(srv, SMALL)[0]) == 3  # room again once they are gone


def test_tokens_per_minute_count_embedded_and_scored_tokens(srv):
    """The probe: 15 requests of 202 tokens under a 300-token minute all got 200."""
    text = " ".join(["word"] * 200)  # 202 tokens with [CLS] and [SEP]
    tight = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=TIGHT, max_retries=0, timeout=60)
    statuses, refused = [], None
    for _ in range(4):
        try:
            assert tight.embeddings.create(model="m", input=text).usage.total_tokens == 202
            statuses.append(200)
        except openai.RateLimitError as exc:
            statuses.append(429)
            refused = exc
    # admitted while the minute is not used up: the second overdraws it, the rest wait
    assert statuses == [200, 200, 429, 429]
    assert int(refused.response.headers["Retry-After"]) >= 1
    assert refused.body["code"] == "rate_limit_exceeded" and "300 tokens per minute" in refused.body["message"]

    http = srv.http()
    score = {"model": "m", "text_1": text, "text_2": ["a b", "c d"]}  # 202 + 4 + 4 tokens read
    got = [http.post("/v1/score", json=score, headers=_auth(TIGHT_SCORE)) for _ in range(3)]
    assert [r.status_code for r in got] == [200, 200, 429]
    assert got[0].json()["usage"]["total_tokens"] == 210 and got[2].headers["Retry-After"]
    assert http.post("/v1/score", json=score, headers=_auth()).status_code == 200  # another key's own budget
