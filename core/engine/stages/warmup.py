"""The engine's start-up warm-up: a few short requests served before the first client's."""

from __future__ import annotations

import logging
import time

from llmkit.core.engine.messages import GenerateRequest, RequestOutput, SamplingParams
from llmkit.core.speculative.speculator import SpecStats

log = logging.getLogger("llmkit")


def warm_up(engine, timeout: float = 300.0) -> None:
    """Serve a few short requests before the first client does: two 32-token prompts together
    (greedy, and top-k/top-p sampled), then one alone of another length with plain sampling,
    then prompts of 1, 33 and 100 tokens together, greedy with nothing for the host to do per row
    (so on CUDA their decode steps chain on the device, as a plain request's do), each 8 decode
    steps (through the captured graphs where there are any). On CUDA the first request otherwise
    pays for compiling and loading the prefill and sampling kernels (a 1.09 s TTFT on the H200;
    0.4 s on the H100 with the first two rounds alone, its 33-token prompt a size they had not
    run). Runs on the calling thread, before the loop starts; leaves the counters as it found
    them (the prompts stay in the prefix cache, evictable)."""
    t0 = time.monotonic()
    n = max(1, min(32, engine.max_context - 9))
    finished: list[RequestOutput] = []
    sink = lambda o: finished.append(o) if o.finished else None  # noqa: E731
    rounds = [
        [
            (n, SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=0.0)),
            (n, SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=0)),
        ],
        [(max(1, n - 7), SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=1.0))],
        # prefill shapes of other sizes in one batch (a GEMM's kernel is picked, and loaded, per size)
        [
            (min(m, engine.max_context - 9), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
            for m in (1, n + 1, 3 * n + 4)
        ],
    ]
    for r, batch in enumerate(rounds):
        for i, (length, params) in enumerate(batch):
            ids = [1 + (i + 7 * r + j) % (engine.vocab_size - 1) for j in range(length)]
            engine.add(GenerateRequest(f"llmkit-warmup-{r}-{i}", ids, params), sink)
        inflight = None
        while engine.has_work(inflight) and time.monotonic() - t0 < timeout:
            inflight = engine.step(inflight)
        engine.output.flush_deferred()
    want = sum(len(b) for b in rounds)
    if len(finished) != want or any(o.error for o in finished):
        raise RuntimeError(f"the start-up warm-up failed: {[o.error for o in finished]}")
    engine.steps = engine.chained_steps = 0
    engine.scheduler.prefix_cache_queries = engine.scheduler.prefix_cache_hits = 0
    if engine.speculator is not None:  # its drafts on the warm-up prompts are no client's
        engine.speculator.stats = SpecStats()
    longest = max(length for batch in rounds for length, _ in batch)
    log.info("Warm-up: %d requests of up to %d prompt tokens, 8 decode steps each, in %.2f s", want, longest,
             time.monotonic() - t0)  # fmt: skip
