"""When a hybrid model's recurrent state is snapshotted for the prefix cache.

A state exists only where a request's computation stopped, so the scheduler asks this class to end
prompt chunks at checkpoints (every ``--state-snapshot-interval`` tokens, rounded to pages, and the
last page boundary before the prompt's last token), snapshots the state there after the step, and
hands the snapshots (and one of the state a request leaves with) to the
:class:`~llmkit.core.kvcache.state_radix_cache.StateRadixCache` when the request leaves.
"""

from __future__ import annotations


class StateSnapshots:
    def __init__(self, states, cache, page: int, interval: int) -> None:
        self.states, self.cache, self.page, self.interval = states, cache, page, interval

    def prompt_mark(self, req) -> int:
        """The deepest position a later request with the same prompt can resume from: the last
        page boundary before the prompt's last token (a match leaves that token to compute)."""
        return (len(req.prompt_ids) - 1) // self.page * self.page

    def chunk_length(self, req, start: int, length: int) -> int:
        """A prompt chunk of a hybrid model ends at its next checkpoint, where its state is
        snapshotted for the prefix cache: a multiple of ``--state-snapshot-interval`` (rounded to
        pages) or :meth:`prompt_mark`."""
        end = start + length
        marks = [self.prompt_mark(req)]
        every = self.interval
        if every > 0:
            every = -(-every // self.page) * self.page
            marks.append((start // every + 1) * every)
        cut = min((m for m in marks if start < m < end), default=end)
        return cut - start

    def after_step(self, req) -> None:
        """After a step: snapshot the state of a request that reached one of its prompt's
        checkpoints (attached to the prefix cache when it leaves)."""
        n = req.num_computed
        if n == 0:
            return
        if n > len(req.prompt_ids):
            if self.page > 1 and n % self.page == 0:  # see _rolling_snapshot
                self._rolling_snapshot(req, n)
            return
        every = -(-self.interval // self.page) * self.page
        if n != self.prompt_mark(req) and (every <= 0 or n % every):
            return
        if req.snapshots and req.snapshots[-1][0] == n:
            return
        snap = self._take(req)
        if snap is not None:
            req.snapshots.append((n, snap))

    def _rolling_snapshot(self, req, n: int) -> None:
        """With pages of several tokens a request rarely leaves on a page boundary, where its final
        state could be cached: while it decodes, one snapshot follows it from boundary to boundary
        (a copy each page; with pages of one token the state it leaves with is snapshotted instead)."""
        if req.snapshots and req.snapshots[-1][0] > len(req.prompt_ids):
            _, slot = req.snapshots[-1]
            self.states.copy(self.states.current(req.req_pool_idx), slot)
            req.snapshots[-1] = (n, slot)
            return
        snap = self._take(req)
        if snap is not None:
            req.snapshots.append((n, snap))

    def _take(self, req) -> int | None:
        if self.states.num_free_snapshots == 0 and hasattr(self.cache, "evict_snapshots"):
            self.cache.evict_snapshots(1)
        return self.states.snapshot(req.req_pool_idx)

    def hand_over(self, req, ids: list[int], n: int) -> None:
        """Hand the request's snapshots, and one of its state now (after ``ids``), to the cache."""
        if not hasattr(self.cache, "attach"):
            return
        if n % self.page == 0 and not (req.snapshots and req.snapshots[-1][0] == n):
            snap = self._take(req)
            if snap is not None:
                req.snapshots.append((n, snap))
        kept = []
        for pos, snap in req.snapshots:
            if pos <= n and self.cache.attach(ids, pos, snap, req.cache_namespace):
                continue
            kept.append((pos, snap))
        req.snapshots = kept
