"""The scheduler's decode fast path: the steady state of every running request decoding one token
with its new pages free, assigned in one batch (``Scheduler.schedule`` tries it first)."""

from __future__ import annotations

from llmkit.core.engine.request import Request, Status
from llmkit.core.engine.scheduling.scheduled_batch import Segment


def decode_segments(sched, order: list[Request], urgent: int | None) -> list[Segment] | None:
    """The running requests' segments when each is one token to decode and their new pages are
    free without evicting or preempting anything (the steady state): what the loop in
    ``Scheduler._running_segments`` makes of them, with their slots assigned in one batch. None, and
    nothing changed, in any other case (a prompt chunk, a draft, pages short)."""
    if sched.speculator is not None:
        return None
    page = sched.page
    picked: list[Request] = []
    needs: list[int] = []
    total = 0
    RUNNING = Status.RUNNING
    # Per request, what seq_len and _pages_needed compute, inline: this loop runs for every
    # running request every step.
    for req in order:
        if req.status is not RUNNING or (urgent is not None and req.priority > urgent):
            continue
        computed = req.num_computed
        remaining = len(req.prompt_ids) + len(req.output_ids) + req.inflight - computed
        if remaining != 1:
            if remaining <= 0:
                continue  # (as the general loop: nothing to compute)
            return None
        short = computed + 1 - req.prefix_len - len(req.own_pages) * page
        need = -(-short // page) if short > 0 else 0
        picked.append(req)
        needs.append(need)
        total += need
    if total > sched.pool.num_free_pages:
        return None  # the general loop evicts, or preempts
    if sched.windows is not None and not sched.windows.assign_decode(picked):
        return None  # (what it took stays the requests': the general loop sees it covered)
    pages = sched.pool.allocate(total) if total else []
    # Each request takes its pages from the end of the batch's, as one allocate() each would.
    hi = total
    rows: list[int] = []
    cols: list[int] = []
    slots: list[int] = []
    for req, need in zip(picked, needs):
        if not need:
            continue
        own = pages[hi - need : hi]
        hi -= need
        first = req.prefix_len + len(req.own_pages) * page
        req.own_pages.extend(own)
        if page == 1 and need == 1:  # a page is a slot: written with the others below
            rows.append(req.req_pool_idx)
            cols.append(first)
            slots.append(own[0])
        else:  # as _assign_slots
            sched.req_pool.write(req.req_pool_idx, first, own if page == 1 else sched.pool.page_slots(own))
    if rows:
        sched.req_pool.write_points(rows, cols, slots)
    return [Segment(req, req.num_computed, 1) for req in picked]
