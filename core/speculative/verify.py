"""Verifying drafted segments: the engine's step for requests that ran 1 + K rows."""

from __future__ import annotations

import itertools


def verify_drafted(engine, segs: list, logits) -> tuple[int, list, object]:
    """Verify the drafted ones among a step's sampling segments (each scored by 1 + K rows of
    ``logits``, in segment order). Returns the tokens they emitted, and the plain segments with
    their one row each, for the ordinary sampling."""
    first = list(itertools.accumulate((1 + len(s.draft) for s in segs), initial=0))
    emitted = sum(verify_draft(engine, s, logits[first[i] : first[i + 1]]) for i, s in enumerate(segs) if s.draft)
    plain = [i for i, s in enumerate(segs) if not s.draft]
    return emitted, [segs[i] for i in plain], logits[[first[i] for i in plain]]


def verify_draft(engine, seg, logits) -> int:
    """Sample the rows of ``seg`` (a segment with draft tokens) in order, each as a plain step
    would (penalties, grammar and stop checks see the tokens kept so far), keeping draft tokens
    while they equal what was sampled: row j scores the token after draft token j, so sampling it
    is exact whatever the draft was, and a seeded request draws exactly as it would without one.
    ``engine`` is the :class:`~llmkit.core.engine.loop.Engine`. Returns the tokens emitted."""
    req, draft = seg.req, seg.draft
    req.inflight = False
    base = seg.start + 1  # K/V are in the pool up to here; each kept draft token adds one
    emitted = accepted = 0
    for j in range(len(draft) + 1):
        if engine.output.get(req.rid) is None:
            break  # ended: a stop, max_tokens, an abort
        req.num_computed = base + j  # so a request ending here caches exactly its valid K/V
        tokens, lps = engine.sampler.sample(logits[j : j + 1], [req])
        if 0 in engine.sampler.failed:
            engine._fail(req, engine.sampler.failed[0])
            break
        engine.output.guarded(req, engine._append_token, req, tokens[0], lps[0])
        emitted += 1
        if j == len(draft) or tokens[0] != draft[j]:
            break
        accepted += 1
    engine.speculator.record(req, len(draft), accepted)
    return emitted
