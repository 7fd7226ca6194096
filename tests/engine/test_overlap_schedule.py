"""The overlap schedule (post-processing deferred past the next launch) changes no output.

On CPU nothing runs asynchronously, so overlap buys no time here, but the deferred code paths are
the same as on CUDA: forcing it on checks stop strings seen one step late, preemption and aborts of
a request with a deferred token, against the same requests run without overlap.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
from transformers import AutoTokenizer

from llmkit.core.engine.messages import GenerateRequest, SamplingParams
from llmkit.core.model.loader.source import resolve_model_dir

from model_utils import start_engine
from server_utils import start_server, stop_server

TEXTS = [
    "Describe a cat.",
    "Describe a dog in detail.",
    "What is rain?",
    "Tell me about Mars.",
    "Why is the sky blue?",
    "Explain gravity to a child.",
]


@pytest.fixture(scope="module")
def prompts():
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    return [
        tok(
            tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for t in TEXTS
    ]


def _params(i: int) -> SamplingParams:
    """A different way to finish (or not) for each prompt."""
    variants = [
        SamplingParams(max_new_tokens=40, temperature=0, stop=(" the",)),  # a stop string mid-output
        SamplingParams(max_new_tokens=40, temperature=0, stop=(".",), no_stop_trim=True),
        SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=7, stop=("\n",)),
        SamplingParams(max_new_tokens=40, temperature=0, stop=(" ",), min_new_tokens=6),
        SamplingParams(max_new_tokens=9, temperature=0, logprobs=True, top_logprobs=2),
        SamplingParams(max_new_tokens=40, temperature=0.7, seed=3, repetition_penalty=1.2),
    ]
    return variants[i % len(variants)]


def _run(engine, prompts) -> list[dict]:
    results = [dict(text="", ids=[], lps=[]) for _ in prompts]
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(out):
            r = results[i]
            r["text"] += out.text
            r["ids"] += out.token_ids
            r["lps"] += [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs]
            if out.finished:
                r["reason"], r["matched"], r["n"] = out.finish_reason, out.matched_stop, out.completion_tokens
                done.release()

        return sink

    for i, ids in enumerate(prompts):
        engine.submit(GenerateRequest(f"r{i}-{id(engine)}", list(ids), _params(i)), sink_for(i))
    for _ in prompts:
        assert done.acquire(timeout=300)
    return results


def _wait_free(engine) -> dict:
    deadline = time.monotonic() + 10
    while engine.stats()["kv_pages_in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.stats()


@pytest.fixture(scope="module")
def reference(prompts):
    engine = start_engine(enable_deterministic_inference=True, overlap_schedule=False)
    try:
        assert engine.overlap is False
        return _run(engine, prompts)
    finally:
        engine.shutdown()


def test_reference_exercises_every_finish(reference):
    reasons = {r["reason"] for r in reference}
    assert {"stop", "length"} <= reasons
    assert any(isinstance(r["matched"], str) for r in reference)  # some stop string was hit


def test_overlap_equals_no_overlap(prompts, reference):
    engine = start_engine(enable_deterministic_inference=True, overlap_schedule=True)
    try:
        assert engine.overlap is True
        assert _run(engine, prompts) == reference
        assert _wait_free(engine)["kv_pages_in_use"] == 0
    finally:
        engine.shutdown()


def test_overlap_with_preemption_and_small_pages(prompts, reference):
    engine = start_engine(
        enable_deterministic_inference=True,
        overlap_schedule=True,
        max_total_tokens=160,
        max_running_requests=6,
        page_size=4,
        chunked_prefill_size=16,
    )
    try:
        assert _run(engine, prompts) == reference
        assert engine.scheduler.num_preemptions > 0
        stats = _wait_free(engine)
        assert stats["kv_pages_in_use"] == 0 and stats["num_waiting_reqs"] == stats["num_running_reqs"] == 0
    finally:
        engine.shutdown()


def test_overlap_with_a_host_mirrored_slot_table(prompts, reference):
    """The device-table path used on GPUs (scheduler writes a host copy; one copy per step),
    forced on CPU, with preemption so rows are freed and handed out again."""
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.loop import Engine
    from llmkit.core.kvcache.kv_pool import ReqToTokenPool

    cfg = EngineConfig(
        grammar_backend="none",
        enable_deterministic_inference=True,
        overlap_schedule=True,
        max_total_tokens=160,
        max_running_requests=6,
        page_size=4,
    )
    parts = build_engine_parts(cfg)
    old = parts.scheduler.req_pool
    pool = ReqToTokenPool(old.table.shape[0], old.table.shape[1], old.table.device, mirror=True)
    assert pool.host is not pool.table
    parts.scheduler.req_pool = parts.runner.req_pool = pool
    engine = Engine(cfg, parts)
    engine.start()
    try:
        assert _run(engine, prompts) == reference
        assert engine.scheduler.num_preemptions > 0
        assert _wait_free(engine)["kv_pages_in_use"] == 0
    finally:
        engine.shutdown()


def test_mirrored_slot_table_flush_keeps_the_last_write():
    import torch

    from llmkit.core.kvcache.kv_pool import ReqToTokenPool

    pool = ReqToTokenPool(3, 8, torch.device("cpu"), mirror=True)
    pool.write(1, 0, torch.tensor([5, 6, 7]))
    pool.write(2, 2, torch.tensor([9]))
    pool.write(1, 1, torch.tensor([11, 12]))  # the same positions again before the flush
    assert pool.table.count_nonzero() == 0  # nothing reaches the device table before a flush
    pool.flush()
    assert pool.table[1, :3].tolist() == [5, 11, 12] and pool.table[2, 2] == 9
    assert torch.equal(pool.table, pool.host)
    assert pool.read(1, 3).tolist() == [5, 11, 12]


def test_abort_with_a_deferred_token_keeps_its_text(prompts):
    engine = start_engine(overlap_schedule=True)
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    got = dict(text="", ids=[])
    done, some = threading.Event(), threading.Event()

    def sink(out):
        got["text"] += out.text
        got["ids"] += out.token_ids
        if len(got["ids"]) >= 5:
            some.set()
        if out.finished:
            got["reason"] = out.finish_reason
            done.set()

    try:
        engine.submit(
            GenerateRequest("a1", list(prompts[1]), SamplingParams(max_new_tokens=500, temperature=0, ignore_eos=True)),
            sink,
        )
        assert some.wait(120)
        engine.abort("a1")
        assert done.wait(30)
        assert got["reason"] == "abort"
        # every token sent was also turned into text, the deferred one included
        assert got["text"] == tok.decode(got["ids"], skip_special_tokens=True)
        assert _wait_free(engine)["kv_pages_in_use"] == 0
    finally:
        engine.shutdown()


def test_server_forced_overlap_streaming_equals_non_streaming(server):
    import httpx
    import openai

    # the shared default server runs on CPU: overlap is off there unless forced
    assert httpx.get(server.base_url + "/get_server_info").json()["overlap_schedule"] is False
    proc, url = start_server(["--enable-overlap-schedule"])
    try:
        assert httpx.get(url + "/get_server_info").json()["overlap_schedule"] is True
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for stop in (["3."], [" and"], None):
            kw = dict(
                model="m",
                messages=[{"role": "user", "content": "List three colors."}],
                max_tokens=60,
                temperature=0,
                stop=stop,
            )
            full = client.chat.completions.create(**kw)
            text = "".join(
                c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True) if c.choices
            )
            assert text == full.choices[0].message.content
    finally:
        stop_server(proc)


def _plain_params(i: int) -> SamplingParams:
    """Rows the sampler can pick on the device (no penalties, bias, grammar or minimum length), so
    the next step chains on the device's picks; a different way to finish for each."""
    variants = [
        SamplingParams(max_new_tokens=30, temperature=0, stop=(" the",)),
        SamplingParams(max_new_tokens=30, temperature=0, stop=(".",), no_stop_trim=True),
        SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_new_tokens=30, temperature=0),  # an EOS, or the length
        SamplingParams(max_new_tokens=7, temperature=0, logprobs=True, top_logprobs=2),
        SamplingParams(max_new_tokens=30, temperature=0.7, top_k=5, seed=3, stop_token_ids=[13]),
    ]
    return variants[i % len(variants)]


@pytest.mark.parametrize("small", [False, True], ids=["roomy", "preempting"])
def test_chained_steps_equal_no_overlap(prompts, small, monkeypatch):
    """Steps launched from the device's picks before the host reads them (the chained path) give
    the same tokens, text, logprobs and finishes as steps run one after the other, with
    preemption and small pages too, and leave no page in use."""
    monkeypatch.setattr(sys.modules[__name__], "_params", _plain_params)
    tight = dict(max_total_tokens=160, max_running_requests=6, page_size=4, chunked_prefill_size=16) if small else {}
    engine = start_engine(enable_deterministic_inference=True, overlap_schedule=False, **tight)
    try:
        want = _run(engine, prompts)
    finally:
        engine.shutdown()
    engine = start_engine(enable_deterministic_inference=True, overlap_schedule=True, **tight)
    try:
        assert _run(engine, prompts) == want
        assert engine.chained_steps > 0
        if small:
            assert engine.scheduler.num_preemptions > 0
        assert _wait_free(engine)["kv_pages_in_use"] == 0
    finally:
        engine.shutdown()
