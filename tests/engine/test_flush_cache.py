"""``Engine.flush_cache`` (SGLang's /flush_cache): drops the prefix cache when idle, refuses while
a request runs or waits, on the engine thread."""

from __future__ import annotations

import queue
import threading

import pytest

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine


@pytest.fixture(scope="module")
def engine():
    e = start_engine()
    yield e
    e.shutdown()


def _flush(engine) -> bool:
    got: queue.SimpleQueue = queue.SimpleQueue()
    engine.flush_cache(got.put)
    return got.get(timeout=30)


def _generate(engine, rid: str, max_new_tokens: int) -> threading.Event:
    done = threading.Event()
    req = GenerateRequest(rid, list(range(10, 60)), SamplingParams(max_new_tokens=max_new_tokens, temperature=0))
    engine.submit(req, lambda out: out.finished and done.set())
    return done


def test_idle_flush_drops_every_cached_page(engine):
    assert _generate(engine, "warm", 4).wait(120)
    assert engine.stats()["kv_pages_cached"] > 0
    assert _flush(engine) is True
    assert engine.stats()["kv_pages_cached"] == 0


def test_flush_is_refused_while_a_request_runs(engine):
    done = _generate(engine, "busy", 64)  # queued before the flush: the engine sees it first
    assert _flush(engine) is False
    engine.abort("busy")
    assert done.wait(120)
