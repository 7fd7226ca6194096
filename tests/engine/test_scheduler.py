"""Continuous batching under pressure, in-process with the embedded model: preemption when KV
pages run out, chunked prefill, and page sizes > 1 give the same tokens as an unconstrained run."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from llmkit.core.engine.messages import GenerateRequest, SamplingParams
from llmkit.core.model.loader.source import resolve_model_dir

from model_utils import start_engine


@pytest.fixture(scope="module")
def prompts():
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    texts = [
        "Describe a cat.",
        "Describe a dog in detail.",
        "What is rain?",
        "Tell me about Mars.",
        "Why is the sky blue?",
        "Explain gravity to a child.",
    ]
    rendered = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    return [tok(r, add_special_tokens=False)["input_ids"] for r in rendered]


def _run(engine, prompts, max_new=40):
    results, done = {}, threading.Semaphore(0)

    def sink_for(i):
        def sink(out):
            results.setdefault(i, []).extend(out.token_ids)
            if out.finished:
                results[f"reason{i}"] = out.finish_reason
                done.release()

        return sink

    for i, ids in enumerate(prompts):
        engine.submit(
            GenerateRequest(
                f"r{i}-{id(engine)}",
                list(ids),
                SamplingParams(max_new_tokens=max_new, min_new_tokens=max_new, temperature=0),
            ),
            sink_for(i),
        )
    for _ in prompts:
        assert done.acquire(timeout=300)
    assert all(results[f"reason{i}"] == "length" for i in range(len(prompts))), results
    return [results[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(prompts):
    engine = start_engine(enable_deterministic_inference=True)
    try:
        return [_run(engine, [p])[0] for p in prompts]
    finally:
        engine.shutdown()


def test_preemption_recomputes_without_failing(prompts, reference):
    # 160 token slots for 6 requests of ~40-50 prompt tokens + 40 new ones: must preempt.
    engine = start_engine(enable_deterministic_inference=True, max_total_tokens=160, max_running_requests=6)
    try:
        out = _run(engine, prompts)
        assert engine.scheduler.num_preemptions > 0
        assert out == reference
        stats = engine.stats()
        assert stats["kv_pages_in_use"] == 0
        # A lone request that would outgrow the whole pool: nothing can be preempted to room for
        # it, so the context is cut to the pool at start and it ends at it (it waited for ever).
        assert engine.max_context < 160
        long_prompt = (prompts[1] * 4)[:150]
        (toks,) = _run_partial(engine, long_prompt, 40)
        assert 0 < len(toks) <= engine.max_context - len(long_prompt) + 1
        assert engine.stats()["kv_pages_in_use"] == 0
    finally:
        engine.shutdown()


def _run_partial(engine, ids, max_new):
    """One request's tokens, however it ends, within a bound."""
    toks, done = [], threading.Event()

    def sink(out):
        toks.extend(out.token_ids)
        if out.finished:
            done.set()

    engine.submit(GenerateRequest(f"long-{id(ids)}", list(ids), SamplingParams(max_new_tokens=max_new)), sink)
    assert done.wait(60), "the request never finished"
    return (toks,)


def test_chunked_prefill_and_pages(prompts, reference):
    engine = start_engine(enable_deterministic_inference=True, chunked_prefill_size=16, page_size=4)
    try:
        assert _run(engine, prompts) == reference
        assert engine.stats()["kv_pages_in_use"] == 0
    finally:
        engine.shutdown()


def test_online_requests_are_admitted_before_batch_lines(prompts):
    engine = start_engine(max_running_requests=1)
    order, done = [], threading.Semaphore(0)

    def sink_for(name):
        def sink(out):
            if out.finished:
                order.append(name)
                done.release()

        return sink

    try:
        reqs = [
            GenerateRequest(f"batch{i}", list(prompts[0]), SamplingParams(max_new_tokens=3, temperature=0), priority=1)
            for i in range(3)
        ]
        reqs.append(GenerateRequest("online", list(prompts[1]), SamplingParams(max_new_tokens=3, temperature=0)))
        # submit all at once: the engine drains its inbox before scheduling
        for r in reqs:
            engine._inbox.put(("add", r, sink_for(r.rid)))
        for _ in reqs:
            assert done.acquire(timeout=120)
        assert order.index("online") <= 1  # at most the line already running finishes first
    finally:
        engine.shutdown()


def test_a_failing_request_fails_alone(prompts):
    """A fault in one request's sampling (here: a corrupt logit_bias that slipped past validation)
    fails only that request; its batch-mate finishes normally and the engine keeps serving."""
    engine = start_engine()
    results, done = {}, threading.Semaphore(0)

    def sink_for(name):
        def sink(out):
            if out.finished:
                results[name] = (out.finish_reason, out.error, out.completion_tokens)
                done.release()

        return sink

    try:
        bad = GenerateRequest(
            "bad", list(prompts[0]), SamplingParams(max_new_tokens=8, min_new_tokens=8, logit_bias={10**9: 1.0})
        )
        good = GenerateRequest(
            "good", list(prompts[1]), SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=0)
        )
        engine._inbox.put(("add", bad, sink_for("bad")))
        engine._inbox.put(("add", good, sink_for("good")))
        for _ in range(2):
            assert done.acquire(timeout=120)
        assert results["bad"][0] == "abort" and "sampling failed" in results["bad"][1]
        assert results["good"] == ("length", None, 8)
        assert engine.is_alive() and engine.stats()["kv_pages_in_use"] == 0
    finally:
        engine.shutdown()
