"""The scheduler's decode fast path (``core/engine/scheduling/decode_segments.py``) gives what its general loop
gives: the same segments, pages, slot table and free list, step after step, for page sizes 1 and
2, and through the step where pages run short (which the general loop handles by preempting)."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.messages import SamplingParams
from llmkit.core.engine.request import Request
from llmkit.core.engine.scheduler import Scheduler
from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.kvcache.radix_cache import RadixCache


def _scheduler(page: int, pages: int) -> Scheduler:
    cpu = torch.device("cpu")
    pool = KVCachePool(
        num_layers=1, num_pages=pages, page_size=page, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=cpu
    )
    req_pool = ReqToTokenPool(9, 256, cpu)
    cfg = EngineConfig(load_format="dummy", max_running_requests=8, chunked_prefill_size=64)
    return Scheduler(cfg, pool, req_pool, RadixCache(pool), 250)


def _state(s: Scheduler, batch) -> tuple:
    segs = [(seg.req.rid, seg.start, seg.length) for seg in batch.segments] if batch else None
    reqs = sorted(s.running + s.waiting, key=lambda r: r.rid)
    return (
        segs,
        [(r.rid, r.status, r.num_computed, list(r.own_pages), r.req_pool_idx) for r in reqs],
        list(s.pool._free),
        s.req_pool.host.clone(),
        s.num_preemptions,
    )


@pytest.mark.parametrize("page,pages", [(1, 400), (2, 200), (1, 60)])
def test_decode_fast_path_matches_the_general_loop(page, pages):
    fast, slow = _scheduler(page, pages), _scheduler(page, pages)
    slow.decode_fast_path = False  # always the general loop
    for s in (fast, slow):
        for i in range(6):
            params = SamplingParams(max_new_tokens=100, temperature=0)
            s.add(Request(f"r{i}", [3 + i, 4, 5, 6 + i] * (i + 1), params, arrival=float(i)))
    took_fast = 0
    for step in range(40):
        got = []
        for s in (fast, slow):
            batch = s.schedule()
            took_fast += s is fast and batch is not None and batch.decode_only
            got.append(_state(s, batch))
            if batch is not None:
                s.on_step_done(batch)
                for seg in batch.segments:
                    if seg.samples:
                        seg.req.output_ids.append(7 + step)
        a, b = got
        assert a[:3] == b[:3] and a[4] == b[4], step
        assert torch.equal(a[3], b[3]), step
    assert took_fast > 10
