"""How the embedding worker fills its forwards, on a model-less encoder that records them: one
input from each waiting request in turn (a small request is not queued behind another's
thousands), and a request cut short (its future cancelled: the client went away) dropped with
its inputs not embedded yet. The servers' end-to-end view is test_embedding_fairness_e2e.py."""

from __future__ import annotations

import torch

from llmkit.core.embedding.engine import EmbeddingEngine
from llmkit.core.embedding.pooling import Pooling


class RecordingEncoder:
    """Each input's states: its token ids as a column, so its mean-pooled vector is their mean."""

    def __init__(self) -> None:
        self.forwards: list[list[list[int]]] = []

    def encode(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        self.forwards.append(inputs)
        return [torch.tensor(row, dtype=torch.float32)[:, None] for row in inputs]


def _engine(max_batch_tokens: int) -> tuple[EmbeddingEngine, RecordingEncoder]:
    model = RecordingEncoder()
    engine = EmbeddingEngine(
        model, Pooling("mean"), device="cpu", max_input_tokens=64, max_batch_tokens=max_batch_tokens, start=False
    )
    return engine, model


def _step(engine: EmbeddingEngine) -> int:
    """One turn of the worker loop without its thread: take what was submitted, run one forward."""
    engine._take_jobs(block=False)
    batch = engine._next_batch()
    if not batch:
        return 0
    for (job, i), result in zip(batch, engine._forward(batch)):
        engine._finish(job, i, result)
    return len(batch)


def test_a_small_request_shares_the_next_forward_with_a_large_one():
    engine, model = _engine(max_batch_tokens=8 * 4)  # 8 inputs of 4 tokens a forward
    big = engine.embed([[1, 1, 1, 1]] * 100)
    _step(engine)  # the large request's first forward is running when the small one comes
    small = engine.embed([[7, 7, 7, 7]])
    _step(engine)
    assert small.done() and small.result() == [[7.0]]
    assert [7, 7, 7, 7] in model.forwards[1] and len(model.forwards[1]) == 8  # shared, not queued
    while _step(engine):
        pass
    assert big.result() == [[1.0]] * 100
    assert engine.stats()["num_embedded_inputs"] == 101


def test_requests_take_turns_across_forwards():
    engine, model = _engine(max_batch_tokens=3 * 2)  # 3 inputs of 2 tokens a forward
    a = engine.embed([[1, 1]] * 4)
    b = engine.embed([[2, 2]] * 4)
    c = engine.embed([[3, 3]])
    while _step(engine):
        pass
    firsts = [[row[0] for row in f] for f in model.forwards]
    # one from each in turn, the turn carried over from one forward to the next
    assert firsts == [[1, 2, 3], [1, 2, 1], [2, 1, 2]]
    assert a.result() == [[1.0]] * 4 and b.result() == [[2.0]] * 4 and c.result() == [[3.0]]


def test_a_cancelled_request_is_dropped_before_the_next_forward():
    engine, model = _engine(max_batch_tokens=4 * 2)
    gone = engine.embed([[1, 1]] * 40)
    _step(engine)
    assert gone.cancel()  # what asyncio.wrap_future does when the route is cancelled
    kept = engine.embed([[5, 5], [6, 6]])
    assert _step(engine) == 2 and kept.result() == [[5.0], [6.0]]
    assert _step(engine) == 0
    stats = engine.stats()
    assert stats["num_dropped_inputs"] == 36 and stats["num_waiting_inputs"] == 0
    assert gone.tokens == 4 * 2 and kept.tokens == 2 * 2  # what a rate limit charges: the tokens embedded


def test_a_request_over_the_queue_bound_is_a_400_naming_the_flag():
    """Never admissible, however long the client waits: a 400, not a 429 to retry forever."""
    from fastapi.testclient import TestClient

    from fake_engine import fake_embedding_app

    for kind, path, over, under in (
        ("embed", "/v1/embeddings", {"input": ["a"] * 5}, {"input": ["a"] * 4}),
        # a bi-encoder scores by embedding each text once: the query and 4 documents are 5
        ("embed", "/v1/score", {"text_1": "q", "text_2": list("abcd")}, {"text_1": "q", "text_2": list("abc")}),
        ("score", "/v1/rerank", {"query": "q", "documents": list("abcde")}, {"query": "q", "documents": list("abcd")}),
    ):
        http = TestClient(fake_embedding_app(kind, max_queued_embedding_inputs=4))
        r = http.post(path, json={"model": "m", **over})
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large", (path, r.text)
        assert "--max-queued-embedding-inputs" in r.json()["error"]["message"]
        assert http.post(path, json={"model": "m", **under}).status_code == 200
