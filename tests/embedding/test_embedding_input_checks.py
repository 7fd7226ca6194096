"""What /v1/embeddings, /v1/score and /v1/rerank refuse before any tokenizer or model work, in
the OpenAI error shape, as the generating routes do: a lone surrogate (which the tokenizer would
raise a TypeError on), and an input longer in characters than the model's input limit could ever
hold. In-process, over a model-less embedder and the packaged encoder's tokenizer."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from fake_engine import fake_embedding_app

SURROGATE = "caf\ud800e"  # JSON "\ud800": a lone surrogate, no Unicode scalar value
LONG = "lorem ipsum dolor sit amet " * 80_000  # 2.16 MB: far beyond 256 tokens, under --max-prompt-size


class SpyTokenizer:
    """The real tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tok) -> None:
        self.tok, self.chars = tok, 0

    def __call__(self, text, pair=None, **kw):
        for arg in (text, pair):
            items = [arg] if isinstance(arg, str) else arg or []
            self.chars += sum(len(t) for t in items if isinstance(t, str))
        return self.tok(text, pair, **kw) if pair is not None else self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module", params=["embed", "score"])
def app(request):
    return fake_embedding_app(request.param)


@pytest.fixture
def spy(app):
    state = app.state.llmkit
    real = state.tokenizer
    state.tokenizer = SpyTokenizer(real)
    yield state.tokenizer
    state.tokenizer = real


def _post(http, path: str, body: dict):
    # json.dumps escapes the lone surrogate, as a client that sends one does (httpx's own
    # encoder would refuse to encode it)
    return http.post(path, content=json.dumps({"model": "m", **body}), headers={"content-type": "application/json"})


def _refused(resp, param: str | None, words: str):
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]
    return error


# (route, body, param) for each kind of server; each body's one bad text is the one named
SURROGATES = {
    "embed": [
        ("/v1/embeddings", {"input": SURROGATE}, "input"),
        ("/v1/embeddings", {"input": ["fine", SURROGATE]}, "input"),
        ("/v1/score", {"text_1": SURROGATE, "text_2": "fine"}, "text_1"),
        ("/v1/score", {"text_1": "fine", "text_2": ["fine", SURROGATE]}, "text_2"),
    ],
    "score": [
        ("/v1/score", {"text_1": SURROGATE, "text_2": "fine"}, "text_1"),
        ("/v1/score", {"text_1": "fine", "text_2": [SURROGATE]}, "text_2"),
        ("/v1/rerank", {"query": SURROGATE, "documents": ["fine"]}, "query"),
        ("/v1/rerank", {"query": "fine", "documents": ["fine", SURROGATE]}, "documents"),
        ("/rerank", {"query": "fine", "documents": [{"text": SURROGATE}]}, "documents"),
    ],
}
LONG_INPUTS = {
    "embed": [
        ("/v1/embeddings", {"input": LONG}, "input"),
        ("/v1/embeddings", {"input": ["fine", LONG]}, "input"),
        ("/v1/score", {"text_1": "fine", "text_2": LONG}, "text_2"),
    ],
    "score": [
        ("/v1/score", {"text_1": LONG, "text_2": "fine"}, "text_1"),
        ("/v1/rerank", {"query": "fine", "documents": ["fine", LONG]}, "documents"),
    ],
}


def _kind(app) -> str:
    return app.state.llmkit.embedder.kind


def _serves_on(http, kind: str) -> None:
    if kind == "embed":
        assert _post(http, "/v1/embeddings", {"input": "still here"}).status_code == 200
    else:
        assert _post(http, "/v1/rerank", {"query": "still", "documents": ["here"]}).status_code == 200


def test_a_lone_surrogate_is_a_400_naming_its_field(app):
    http = TestClient(app)
    for path, body, param in SURROGATES[_kind(app)]:
        _refused(_post(http, path, body), param, "lone surrogate")
    _serves_on(http, _kind(app))


def test_an_input_too_long_for_the_model_is_refused_before_tokenizing(app, spy):
    http = TestClient(app)
    for path, body, param in LONG_INPUTS[_kind(app)]:
        error = _refused(_post(http, path, body), param, "longer than the model's context length")
        assert error["code"] == "context_length_exceeded"
    assert spy.chars < 10_000  # the short texts beside the long ones (and a probe of the tokenizer)
    _serves_on(http, _kind(app))


def test_whitespace_the_tokenizer_drops_does_not_count(app):
    """WordPiece drops whitespace: a text padded with it is served while its tokens fit."""
    padded = "   ".join(["aligned   column\n"] * 400)  # 10,000 characters, about 800 tokens
    words = " ".join(["aligned column"] * 100)  # 200 tokens, however wide its padding
    wide = words.replace(" ", " " * 60)
    assert len(wide) > 256 * 32
    http = TestClient(app)
    if _kind(app) == "embed":
        assert _post(http, "/v1/embeddings", {"input": wide}).status_code == 200
        assert _post(http, "/v1/embeddings", {"input": padded}).status_code == 400  # its tokens do not fit
    else:
        assert _post(http, "/v1/rerank", {"query": "column", "documents": [wide]}).status_code == 200


def test_truncation_asked_for_takes_a_long_input():
    app = fake_embedding_app("embed")
    resp = _post(TestClient(app), "/v1/embeddings", {"input": "word " * 2000, "truncate_prompt_tokens": 16})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == 16
