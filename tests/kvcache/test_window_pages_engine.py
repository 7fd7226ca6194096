"""Window layers that keep only their window (core/kvcache/window_pages.py), in the real engine on
tiny random-weight gpt-oss, Gemma 3, Gemma 4, OLMo 3 and Mistral (every layer a window) checkpoints whose window (4 tokens) is far shorter than the
prompts: outputs equal ``--swa-full``'s bit for bit (greedy tokens and their logprobs) under
concurrent requests, small pages, prefill chunks across the window boundary and preemption; a
prefix-cache hit past the window equals a run without the cache; a long request holds a bounded
number of window pages; every page of both kinds comes back after the requests end or abort."""

from __future__ import annotations

import threading
import time

import gemma4_utils as g4
import pytest

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

import breadth_utils as breadth
import gemma3_utils as g3
from model_utils import assert_same_as_generate, copy_embedded_tokenizer, save_tiny_model, start_engine

WINDOW = 4
PROMPTS = [[(31 * i + 7 * j) % 300 + 5 for j in range(14 + 5 * i)] for i in range(5)]
N = 10


@pytest.fixture(scope="module", params=["gpt_oss", "gemma3", "gemma4", "olmo3", "mistral"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt_oss":
        ref = save_tiny_model("gpt_oss", path, sliding_window=WINDOW)
        copy_embedded_tokenizer(path)
    elif request.param == "gemma3":
        ref = g3.save_tiny_gemma3_text(path, sliding_window=WINDOW)
    elif request.param in ("olmo3", "mistral"):  # sliding, full, sliding; Mistral: every layer sliding
        ref = breadth.save_tiny(request.param, path, sliding_window=WINDOW)
    else:  # every Gemma 4 feature: MoE, per-layer inputs, K/V shared across layers, wider full heads
        ref = g4.save_tiny_gemma4_text(path, "all", sliding_window=WINDOW)
    # Gemma 4 (its MoE and per-layer inputs) is not batch-invariant to the last bit even with
    # full-length K/V: its logprobs are compared within rounding, the others' bit for bit
    return ref, str(path), request.param != "gemma4"


def _same(a, b, exact: bool) -> bool:
    """The same tokens, and logprobs equal (``exact``) or within rounding."""
    if exact:
        return [r[:2] for r in a] == [r[:2] for r in b]
    return [r[0] for r in a] == [r[0] for r in b] and all(x[1] == pytest.approx(y[1], abs=1e-4) for x, y in zip(a, b))


def _run(engine, prompts, n=N, watch=None) -> list[tuple[list[int], list[float], int]]:
    """Greedy tokens, their logprobs and the cached prompt tokens of each prompt, run concurrently."""
    outs = [([], [], [0]) for _ in prompts]
    left = threading.Semaphore(0)
    for i, ids in enumerate(prompts):

        def sink(o, i=i):
            outs[i][0].extend(o.token_ids)
            outs[i][1].extend(lp.logprob for lp in o.logprobs)
            if watch is not None:
                watch()
            if o.finished:
                outs[i][2][0] = o.cached_tokens
                left.release()

        params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0, logprobs=True)
        engine.submit(GenerateRequest(f"r{i}-{time.monotonic_ns()}", list(ids), params), sink)
    for _ in prompts:
        assert left.acquire(timeout=300)
    return [(a, b, c[0]) for a, b, c in outs]


def _idle_stats(engine) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = engine.stats()
        if not s["kv_pages_in_use"] and not s.get("kv_window_pages_in_use"):
            break
        time.sleep(0.05)
    return engine.stats()


def _engine(path, **kw):
    base = dict(model_path=path, device="cpu", page_size=2, chunked_prefill_size=8, enable_deterministic_inference=True)
    return start_engine(**{**base, **kw})


def test_window_pages_equal_full_length_window_kv(model):
    """Concurrent prompts in a pool too small for all of them (preemption), prefill chunks of 8
    across the 4-token window, pages of 2; then the next turn of the first conversation."""
    ref, path, exact = model
    results = {}
    for full in (False, True):
        # (the window run's budget is smaller: split between its two pools, it would hold all)
        # (Mistral's every layer is a window layer: all of its budget is window pages, so less:
        # room for two requests at once)
        window_budget = 20 if "mistral" in path else 34
        engine = _engine(path, max_total_tokens=64 if full else window_budget, max_running_requests=5, swa_full=full)
        try:
            assert (engine.scheduler.windows is None) == full
            first = _run(engine, PROMPTS)
            # (an all-window model's requests never outgrow what admission gave them: they wait)
            assert full or "mistral" in path or engine.scheduler.num_preemptions > 0
            turn = PROMPTS[0] + first[0][0] + [7, 8, 9]
            second = _run(engine, [turn])
            stats = _idle_stats(engine)
            assert stats["kv_pages_in_use"] == 0
            if not full:
                assert stats["kv_window_pages_in_use"] == 0
                # fewer window pages than full ones: the saving itself
                assert stats["kv_window_pages_total"] < stats["kv_pages_total"]
        finally:
            engine.shutdown()
        results[full] = (first, second)
    # tokens and logprobs bit for bit (the cached tokens depend on each pool's pressure)
    assert _same(results[False][0] + results[False][1], results[True][0] + results[True][1], exact)
    first = results[False][0]
    for ids, (toks, _, _) in zip(PROMPTS, first):
        assert_same_as_generate(ref, ids, toks, "window pages")


def test_speculative_steps_equal_full_length_window_kv(model):
    """N-gram drafts (a repetitive prompt: drafts accepted and rejected) over window pages: the
    rejected drafts' positions roll back without a page the window gave back."""
    _, path, exact = model
    prompt = ([5, 6, 7, 8, 9, 10] * 5)[:27]
    outs = []
    for full in (False, True):
        engine = _engine(path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, swa_full=full)
        try:
            outs.append(_run(engine, [prompt, PROMPTS[2]], n=16))
            assert _idle_stats(engine)["kv_pages_in_use"] == 0
        finally:
            engine.shutdown()
    assert _same(outs[0], outs[1], exact)


def test_prefix_hit_past_the_window_equals_no_cache(model):
    _, path, exact = model
    long = PROMPTS[4]
    engine = _engine(path)
    try:
        first = _run(engine, [long])
        again = _run(engine, [long + first[0][0] + [11, 12]])
        assert again[0][2] >= len(long)
    finally:
        engine.shutdown()
    engine = _engine(path, disable_radix_cache=True)
    try:
        assert _same(_run(engine, [long + first[0][0] + [11, 12]]), again, exact)
    finally:
        engine.shutdown()


def test_a_long_request_holds_a_bounded_window(model):
    """A 60-token prompt and 40 new tokens: the window pool never holds more than the window and
    a prefill chunk of it, while the full layers hold all 100 positions."""
    _, path, exact = model
    engine = _engine(path, page_size=1)
    held = []
    sched = engine.scheduler

    def watch():
        running = list(sched.running)
        held.append(max((sched.windows.held_pages(r) for r in running), default=0))

    try:
        prompt = [(13 * j) % 300 + 5 for j in range(60)]
        _run(engine, [prompt], n=40, watch=watch)
    finally:
        engine.shutdown()
    assert len(held) >= 40
    assert max(held) <= WINDOW + 8  # the window and the chunk in flight (8 tokens, pages of 1)


def test_pages_come_back_after_aborts(model):
    _, path, exact = model
    engine = _engine(path, max_total_tokens=200)
    try:
        got = threading.Event()

        def sink(o):
            if o.token_ids:
                got.set()

        params = SamplingParams(max_new_tokens=200, min_new_tokens=200, temperature=0)
        for i, ids in enumerate(PROMPTS[:3]):
            engine.submit(GenerateRequest(f"abort-{i}", ids, params), sink)
        assert got.wait(60)
        for i in range(3):
            engine.abort(f"abort-{i}")
        stats = _idle_stats(engine)
        assert stats["kv_pages_in_use"] == 0 and stats["kv_window_pages_in_use"] == 0
        assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0
        # and the engine still serves, its cache reused
        assert len(_run(engine, [PROMPTS[1]])[0][0]) == N
    finally:
        engine.shutdown()


def test_pages_come_back_after_a_failing_step(model):
    """A forward that raises for one request (fault injected as tests/engine/test_step_isolation.py
    does): it fails alone, the others finish, and no page of either kind stays in use."""
    _, path, exact = model
    mark = 310  # a prompt holding this id makes the forward raise
    engine = _engine(path)
    try:
        real = engine.runner.run

        def run(batch, prev=None):
            if any(mark in s.req.prompt_ids for s in batch.segments):
                raise RuntimeError("injected kernel fault")
            return real(batch, prev)

        engine.runner.run = run
        errors = {}
        left = threading.Semaphore(0)
        prompts = {"bad": PROMPTS[3][:20] + [mark] + PROMPTS[3][20:], "good": PROMPTS[4]}
        for rid, ids in prompts.items():

            def sink(o, rid=rid):
                if o.finished:
                    errors[rid] = o.error
                    left.release()

            engine.submit(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=N, temperature=0)), sink)
        for _ in prompts:
            assert left.acquire(timeout=300)
        assert errors["bad"] and not errors["good"]
        stats = _idle_stats(engine)
        assert stats["kv_pages_in_use"] == 0 and stats["kv_window_pages_in_use"] == 0
    finally:
        engine.shutdown()
