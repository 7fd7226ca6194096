"""/v1/rerank and /v1/score end to end on a tiny random ``BertForSequenceClassification`` (a
cross-encoder recognised from its config), against sentence-transformers' ``CrossEncoder``."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

WORDS = "the a cat dog sat on mat river bank money paris france capital city night rain sun is of what where".split()
QUERY = "where is the capital of france"
DOCS = [
    "paris is the capital of france",
    "the cat sat on the mat",
    "money in the river bank",
    "rain at night in the city",
    "what is the sun",
]
MAX_INPUTS = 16


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("tiny-cross-encoder")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    with torch.no_grad():  # random init is tiny: widen it so the scores spread out
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
        model.classifier.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rerank_server(cross_encoder_dir):
    from tests.conftest import _server

    yield from _server(["--model-path", str(cross_encoder_dir), "--max-embedding-inputs", str(MAX_INPUTS)])


@pytest.fixture(scope="module")
def want(cross_encoder_dir):
    """CrossEncoder.predict's scores of (QUERY, doc) for each doc: the sigmoid of the logit."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(cross_encoder_dir), device="cpu")
    return model.predict([(QUERY, d) for d in DOCS]).tolist()


def test_rerank_matches_cross_encoder_sorted_and_cut(rerank_server, want):
    http = rerank_server.http()
    body = http.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS}).json()
    assert set(body) == {"id", "model", "usage", "results"} and body["model"] == "m"
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
        assert r["document"] == {"text": DOCS[r["index"]]}
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [r["index"] for r in results] == order
    assert len(set(round(w, 3) for w in want)) == len(DOCS)  # distinct: the order is a real check
    assert body["usage"]["total_tokens"] > len(DOCS) * 4

    # top_n, documents as objects, no documents back; also at /rerank and /v2/rerank
    docs = [{"text": d} for d in DOCS]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        cut = http.post(path, json={"query": QUERY, "documents": docs, "top_n": 2, "return_documents": False}).json()
        assert [r["index"] for r in cut["results"]] == order[:2]
        assert all(set(r) == {"index", "relevance_score"} for r in cut["results"])


def test_concurrent_requests_share_forwards_and_scores(rerank_server, want):
    """Requests of different sizes at once: batched together (padded, token types and all), each
    score as alone."""
    from concurrent.futures import ThreadPoolExecutor

    subsets = [DOCS[i:] + DOCS[:i] for i in range(len(DOCS))] + [DOCS[:1], DOCS[2:4]]

    def rerank(docs):
        body = rerank_server.http().post("/v1/rerank", json={"query": QUERY, "documents": docs}).json()
        return {docs[r["index"]]: r["relevance_score"] for r in body["results"]}

    with ThreadPoolExecutor(len(subsets)) as pool:
        for docs, got in zip(subsets, pool.map(rerank, subsets)):
            assert got == pytest.approx({d: want[DOCS.index(d)] for d in docs}, abs=1e-4)


def test_score_one_to_n_and_n_to_n(rerank_server, want, cross_encoder_dir):
    http = rerank_server.http()
    body = http.post("/v1/score", json={"model": "m", "text_1": QUERY, "text_2": DOCS}).json()
    assert body["object"] == "list" and body["model"] == "m" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in body["data"])
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0

    # N to N, and the raw logits (use_activation: false) whose sigmoid the scores are
    firsts = [DOCS[0], QUERY]
    pairs = http.post("/score", json={"text_1": firsts, "text_2": DOCS[:2], "use_activation": False}).json()
    from sentence_transformers import CrossEncoder

    logits = CrossEncoder(str(cross_encoder_dir), device="cpu", activation_fn=torch.nn.Identity())
    raw = logits.predict(list(zip(firsts, DOCS[:2]))).tolist()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(raw, abs=1e-4)


BAD_RERANK = {
    "empty query": {"query": "", "documents": DOCS},
    "query not a string": {"query": ["a"], "documents": DOCS},
    "no query": {"documents": DOCS},
    "empty documents": {"query": QUERY, "documents": []},
    "documents a string": {"query": QUERY, "documents": "paris"},
    "a number among documents": {"query": QUERY, "documents": ["paris", 3]},
    "an empty document": {"query": QUERY, "documents": ["paris", ""]},
    "an object without text": {"query": QUERY, "documents": [{"content": "paris"}]},
    "negative top_n": {"query": QUERY, "documents": DOCS, "top_n": -1},
    "top_n a string": {"query": QUERY, "documents": DOCS, "top_n": "2"},
    "too many documents": {"query": QUERY, "documents": ["paris"] * (MAX_INPUTS + 1)},
    "a pair over the max length": {"query": QUERY, "documents": ["paris " * 70]},
}
BAD_SCORE = {
    "empty text_1": {"text_1": [], "text_2": DOCS},
    "2 to 3": {"text_1": DOCS[:2], "text_2": DOCS[:3]},
    "a number": {"text_1": QUERY, "text_2": 5},
}


@pytest.mark.parametrize("path, body", [*(("/v1/rerank", b) for b in BAD_RERANK.values()),
                                        *(("/v1/score", b) for b in BAD_SCORE.values())],
                         ids=[*BAD_RERANK, *BAD_SCORE])  # fmt: skip
def test_bad_requests_are_400s_and_the_server_serves_on(rerank_server, path, body):
    resp = rerank_server.http().post(path, json={"model": "m", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    ok = rerank_server.http().post("/v1/rerank", json={"query": QUERY, "documents": DOCS[:1]})
    assert ok.status_code == 200


def test_other_routes_say_the_model_reranks(rerank_server):
    client = rerank_server.client
    with pytest.raises(openai.BadRequestError, match="reranks"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="is a reranker"):
        client.embeddings.create(model="m", input="hello")
    resp = httpx.post(rerank_server.base_url + "/v1/rerank", json={"model": "gpt-4", "query": "a", "documents": ["b"]})
    assert resp.status_code == 404
