"""The embedded model on the torch backend: K/V loaded from the storage tier is bit for bit the
K/V that was computed, so the output after a restart equals the output on the device-cached
prefix exactly (tokens and logprobs) and the recomputed output's greedy tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine

# 4 blocks of 64, then 9 tokens: the device cache (pages of 16) and the tier (blocks of 64) both
# hold 256 tokens of it, so both runs compute the same 9-token step after the prefix.
IDS = [(i * 7919) % 20000 + 50 for i in range(265)]


def _run(engine, rid: str, ids: list[int], salt: str | None = None):
    done, toks, lps, info = threading.Event(), [], [], {}

    def sink(o):
        toks.extend(o.token_ids)
        lps.extend(lp.logprob for lp in o.logprobs)
        if o.finished:
            info.update(cached=o.cached_tokens, error=o.error)
            done.set()

    params = SamplingParams(max_new_tokens=12, min_new_tokens=12, temperature=0, logprobs=True)
    engine.submit(GenerateRequest(rid, ids, params, cache_salt=salt), sink)
    assert done.wait(300)
    assert info["error"] is None
    return toks, lps, info["cached"]


def _prefix_rows(engine, n: int) -> list[torch.Tensor]:
    """The pool's bytes of the cached prefix (the engine is idle: read from this thread)."""
    pool = engine.scheduler.pool
    slots, _ = engine.scheduler.cache.match_prefix(IDS[:n])
    assert len(slots) == n
    return [b.view(torch.uint8)[slots].clone() for b in pool.k_buffers + pool.v_buffers]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("tier")
    kw = dict(
        attention="torch", page_size=16, device="cpu", enable_hierarchical_cache=True, hicache_storage_path=str(path)
    )
    engine = start_engine(**kw)
    try:
        recomputed = _run(engine, "a", IDS)
        on_device = _run(engine, "b", IDS)
        assert engine.scheduler.tier.flush()
        rows = _prefix_rows(engine, 256)
    finally:
        engine.shutdown()
    return kw, recomputed, on_device, rows


def test_after_a_restart_the_tier_serves_the_same_bits(first_run):
    kw, recomputed, on_device, rows = first_run
    assert recomputed[2] == 0 and on_device[2] == 256
    engine = start_engine(**kw)
    try:
        toks, lps, cached = _run(engine, "c", IDS)
        assert cached == 256 and engine.stats()["tier_hit_tokens"] == 256
        assert all(torch.equal(a, b) for a, b in zip(_prefix_rows(engine, 256), rows))
        assert (toks, lps) == on_device[:2]  # the same computation on the same bits: exactly equal
        assert toks == recomputed[0]
        # An owner's salt is a namespace of its own, in the tier as on the device
        assert _run(engine, "d", IDS, salt="alice")[2] == 0
        assert _run(engine, "e", IDS, salt="alice")[2] == 256
        assert _run(engine, "f", IDS, salt="bob")[2] == 0
    finally:
        engine.shutdown()
