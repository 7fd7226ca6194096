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
    A tree's rows are walked from the root: the sampled token picks the child that carries it.
    ``engine`` is the :class:`~llmkit.core.engine.loop.Engine`. Returns the tokens emitted."""
    req, draft = seg.req, seg.draft
    tree = seg.tree
    req.inflight = False
    base = seg.start + 1  # K/V are in the pool up to here; each kept draft token adds one
    emitted = accepted = 0
    # A hybrid model's state layers ran every draft token: unless all are kept, the state is the one
    # before the step (still in the other working slot) and the kept tokens are computed again with
    # the next step; until it is known, a request ending here leaves with that state.
    states = engine.scheduler.states
    if states is not None:
        states.unflip(req.req_pool_idx)
        base = seg.start
    node = -1  # the row sampled next: node + 1 (the root's row first)
    while True:
        if engine.output.get(req.rid) is None:
            break  # ended: an abort
        # so a request ending here caches exactly its valid K/V (a hybrid's: none of this step's)
        req.num_computed = base + (accepted if states is None else 0)
        tokens, lps = engine.sampler.sample(logits[node + 1 : node + 2], [req])
        if 0 in engine.sampler.failed:
            engine.fail(req, engine.sampler.failed[0])
            break
        engine.output.guarded(req, engine.append_token, req, tokens[0], lps[0])
        emitted += 1
        if engine.output.get(req.rid) is None:
            break  # that token ended it
        if tree is None:
            nxt = node + 1 if node + 1 < len(draft) and tokens[0] == draft[node + 1] else None
        else:
            nxt = tree.child(node, tokens[0])
        if nxt is None:
            break
        accepted += 1
        if nxt != accepted - 1:  # a tree node off the main chain: its K/V to the position it now holds
            engine.runner.move_kv_column(req.req_pool_idx, seg.start + 1 + nxt, seg.start + accepted)
        node = nxt
    if states is not None and accepted == len(draft) and engine.output.get(req.rid) is not None:
        states.unflip(req.req_pool_idx)  # every draft token kept: the step's state is the request's
        req.num_computed = seg.start + 1 + accepted
    engine.speculator.record(req, len(draft), accepted, None if tree is None else max(tree.depths()))
    return emitted
