"""Per-key rate limits: the token buckets on a fake clock, and the 429s in-process (fake engine)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from llmkit.core.server.access.rate_limits import RateLimiter

from fake_engine import fake_app


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_burst_then_refill():
    clock = Clock()
    limiter = RateLimiter(rpm=3, tpm=0, clock=clock)
    assert [limiter.admit() for _ in range(3)] == [None, None, None]
    assert limiter.admit() == (20, "3 requests per minute")  # one request comes back every 20 s
    clock.now += 19.5
    assert limiter.admit() == (1, "3 requests per minute")  # Retry-After rounds up, never 0
    clock.now += 0.5
    assert limiter.admit() is None


def test_a_refused_request_is_not_counted():
    clock = Clock()
    limiter = RateLimiter(rpm=1, tpm=0, clock=clock)
    assert limiter.admit() is None
    for _ in range(5):
        assert limiter.admit() is not None
    clock.now += 60
    assert limiter.admit() is None


def test_tokens_are_charged_when_counted_and_may_overdraw():
    clock = Clock()
    limiter = RateLimiter(rpm=0, tpm=600, clock=clock)  # 10 tokens a second
    assert limiter.admit() is None
    limiter.charge(500)
    assert limiter.admit() is None  # 100 left
    limiter.charge(700)  # one long answer overdraws the minute by 600
    assert limiter.admit() == (60, "600 tokens per minute")
    clock.now += 60
    assert limiter.admit() is None


def test_no_limits_never_refuse():
    limiter = RateLimiter(rpm=0, tpm=None)
    limiter.charge(10**9)
    assert all(limiter.admit() is None for _ in range(1000))


def _keys(tmp_path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_429_with_retry_after_in_each_api_shape_per_key(tmp_path):
    keys = _keys(tmp_path, "sk-a alice rpm=2\nsk-b bob\n")
    with TestClient(fake_app(api_keys_file=keys, rate_limit_rpm=100)) as http:
        alice = {"Authorization": "Bearer sk-a"}
        assert [http.get("/v1/models", headers=alice).status_code for _ in range(2)] == [200, 200]
        r = http.get("/v1/models", headers=alice)
        assert r.status_code == 429 and r.headers["Retry-After"] == "30"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "2 requests per minute" in r.json()["error"]["message"] and "sk-a" not in r.text
        r = http.post("/v1/messages", headers={"x-api-key": "sk-a"}, json={})
        assert r.status_code == 429 and r.headers["Retry-After"] == "30"
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
        # bob has his own bucket (the server's 100 a minute)
        assert http.get("/v1/models", headers={"Authorization": "Bearer sk-b"}).status_code == 200
        assert http.get("/health").status_code == 200  # never limited


def test_tokens_per_minute_count_prompt_and_completion():
    with TestClient(fake_app(api_keys=("sk-a",), rate_limit_tpm=60)) as http:
        auth = {"Authorization": "Bearer sk-a"}
        body = {"model": "m", "prompt": "Hello there", "max_tokens": 40}  # the fake engine writes all 40
        first = http.post("/v1/completions", headers=auth, json=body)
        assert first.status_code == 200 and 40 < first.json()["usage"]["total_tokens"] < 60
        assert http.post("/v1/completions", headers=auth, json=body).status_code == 200  # some left: admitted
        r = http.post("/v1/completions", headers=auth, json=body)  # the second overdrew the minute
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 20
        assert "60 tokens per minute" in r.json()["error"]["message"]


def test_limits_apply_without_keys_to_the_one_anonymous_caller():
    with TestClient(fake_app(rate_limit_rpm=1)) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.get("/v1/models").status_code == 429


def test_tokens_per_minute_count_embedding_rerank_and_score_tokens():
    """Issue 52's probe: 15 /v1/embeddings requests of 202 tokens under a 300-token minute all
    got 200. The tokens embedded or scored (the usage) now count, as generated ones do."""
    from fake_engine import fake_embedding_app

    text = " ".join(["word"] * 200)  # 202 tokens with [CLS] and [SEP]
    calls = {
        "embed": [("/v1/embeddings", {"model": "m", "input": text}), ("/v1/score", {"text_1": text, "text_2": "a"})],
        "score": [("/v1/rerank", {"query": text, "documents": ["a"]}), ("/v1/score", {"text_1": text, "text_2": "a"})],
    }
    for kind, routes in calls.items():
        for path, body in routes:
            with TestClient(fake_embedding_app(kind, rate_limit_tpm=300)) as http:
                got = [http.post(path, json=body) for _ in range(4)]
                assert [r.status_code for r in got] == [200, 200, 429, 429], (kind, path)
                assert got[0].json()["usage"]["total_tokens"] >= 202
                r = got[2]
                assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
                assert "300 tokens per minute" in r.json()["error"]["message"]
