"""Decides what runs each step: continuous batching under a token budget, with preemption.

Every step is one forward over "segments": each running request contributes the tokens whose K/V
are not yet in the pool — one token when decoding, a chunk of the prompt while prefilling — so
prefill chunks and decode tokens share a batch. New requests are admitted between steps, online
traffic before batch lines. When KV pages run out, cached prefixes are evicted first, then the
most recently admitted request of the lowest priority is preempted: its K/V goes to the prefix
cache and it is recomputed later (never failed).
"""

from __future__ import annotations

import operator
import time

import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.request import Request, Status
from llmkit.core.engine.scheduling.decode_segments import decode_segments
from llmkit.core.engine.scheduling.scheduled_batch import ScheduledBatch, Segment
from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.kvcache.prefix_cache import PrefixCache
from llmkit.core.multimodal.step_rows import whole_images as _whole_images
from llmkit.core.speculative.tree import DraftTree

# --schedule-policy: first come, first served, or the longest cached prefix first.
SCHEDULE_POLICIES = ("fcfs", "lpm")


class Scheduler:
    #: try the decode fast path (scheduling/decode_segments.py) first; tests turn it off to compare with the loop
    decode_fast_path = True

    def __init__(
        self, config: EngineConfig, pool: KVCachePool, req_pool: ReqToTokenPool, cache: PrefixCache, max_context: int
    ) -> None:
        self.config = config
        self.pool = pool
        self.req_pool = req_pool
        self.cache = cache
        self.page = pool.page_size
        self.max_context = max_context
        self.speculator = None  # a core.speculative Speculator when --speculative-algorithm is set
        # A hybrid model's state pool (set by the builder; the cache is then a StateRadixCache or none)
        self.states = None
        self.snapshots = None  # a StateSnapshots over them
        # Window layers' own pages (core/kvcache/window_pages.py), where kept apart (set by the builder)
        self.windows = None
        self.tier = None  # the storage tier under the prefix cache (core/kvcache/storage_tier.py)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at first admission, and those it held.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def use_states(self, states) -> None:
        """Serve a hybrid model: its state pool (the cache is then a StateRadixCache, or none)."""
        from llmkit.core.kvcache.state_snapshots import StateSnapshots

        self.states = states
        self.snapshots = StateSnapshots(states, self.cache, self.page, self.config.state_snapshot_interval)

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        if self.tier is not None and req.tier_namespace is not None and not req.needs_prompt_logits:
            self.tier.prefetch(req.rid, req.all_ids[:-1], req.tier_namespace, req.cache_namespace)

    def abort(self, rid: str) -> Request | None:
        for i, r in enumerate(self.waiting):
            if r.rid == rid:
                del self.waiting[i]
                if self.tier is not None:
                    self.tier.forget(rid)
                r.status = Status.FINISHED
                r.finish_reason = r.finish_reason or "abort"
                if self.speculator is not None:  # preempted after drafting: its backoff state too
                    self.speculator.release(r)
                return r
        for r in self.running:
            if r.rid == rid:
                self.finish(r, "abort")
                return r
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- pages -------------------------------------------------------------------------------
    def _pages_needed(self, req: Request, upto: int) -> int:
        """Pages ``req`` must still allocate to hold tokens [0, upto)."""
        covered = req.prefix_len + len(req.own_pages) * self.page
        return max(0, -(-(upto - covered) // self.page))

    def _allocate(self, n: int) -> list[int] | None:
        if n > self.pool.num_free_pages:
            self.cache.evict(n - self.pool.num_free_pages)
        return self.pool.allocate(n)

    def available_pages(self) -> int:
        return self.pool.num_free_pages + self.cache.evictable_pages

    def _assign_slots(self, req: Request, end: int) -> bool:
        """Make sure ``req`` owns slots for tokens [0, end); False if pages ran out."""
        need = self._pages_needed(req, end)
        if need:
            pages = self._allocate(need)
            if pages is None:
                return False
            first = req.prefix_len + len(req.own_pages) * self.page
            req.own_pages.extend(pages)
            slots = pages if self.page == 1 else self.pool.page_slots(pages)  # a page is a slot at size 1
            self.req_pool.write(req.req_pool_idx, first, slots)
        return self.windows is None or self.windows.assign(req, end)

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.chunked_prefill_size
        if self.tier is not None:
            self.tier.poll()  # (the prefixes its writer has read are evictable again)
        self._order_waiting()
        # A more urgent request (online traffic) waiting to start: lower-priority requests (batch
        # lines) sit this step out, so its prefill runs without them and its first token comes
        # as fast as on an idle server. They resume next step with their KV intact.
        urgent = self._urgent_priority()
        # 1. requests already running: their next token (or next prompt chunk)
        order = sorted(self.running, key=_RUN_ORDER)
        segments = decode_segments(self, order, urgent) if self.decode_fast_path else None
        decode_only = segments is not None
        if decode_only:
            budget -= len(segments)
        else:
            segments, budget = self._running_segments(order, urgent, budget)
        batch = ScheduledBatch(segments, num_running_before=len(self.running))
        # 2. admit waiting requests while budget, slots and pages allow
        admitted = []
        adapters: set | None = None  # the running adapters, gathered once a LoRA request waits
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.inflight:  # preempted with a token still on its way: admit it once it arrives
                continue
            if self.tier is not None and not self.tier.ready(req.rid):
                continue  # its prefix is still coming from the storage tier
            if req.lora is not None:
                if adapters is None:
                    adapters = {r.lora.uid for r in self.running if r.lora is not None}
                if req.lora.uid not in adapters and len(adapters) >= self.config.max_loras_per_batch:
                    continue  # --max-loras-per-batch: waits for a running adapter's requests to end
                adapters.add(req.lora.uid)
            if self.req_pool.num_free == 0:
                break
            seg = self._admit(req, budget, reserve=len(self.running))
            if seg is None:
                break  # keep arrival order: don't let smaller requests overtake forever
            admitted.append(req)
            segments.append(seg)
            budget -= seg.length
            batch.num_new_prefill_seqs += 1
            batch.num_prefill_tokens += seg.length
            batch.num_cached_tokens += req.prefix_len
        for req in admitted:
            self.waiting.remove(req)
        batch.decode_only = decode_only and not admitted
        if not segments and self.tier is not None:
            self.tier.wait_briefly()  # (only prefetches to wait for: no busy loop)
        return batch if segments else None

    def _running_segments(self, order: list[Request], urgent: int | None, budget: int) -> tuple[list[Segment], int]:
        """The running requests' segments (``order``: by priority, then arrival), preempting the
        least urgent where pages run out; and the budget left."""
        segments: list[Segment] = []
        for req in order:
            if req.status is not Status.RUNNING:
                continue
            if urgent is not None and req.priority > urgent:
                continue
            remaining = req.seq_len + req.inflight - req.num_computed
            length = remaining if remaining == 1 else min(remaining, max(budget, 0))
            if length > 1:
                length = _whole_images(req, req.num_computed, length)
                if self.snapshots is not None:
                    length = self.snapshots.chunk_length(req, req.num_computed, length)
            if length <= 0:
                continue
            draft = self.speculator.draft(req) if self.speculator and remaining == 1 and not req.inflight else []
            tree = draft if isinstance(draft, DraftTree) else None
            if tree is not None:
                draft = list(tree.tokens)
            length += len(draft)
            while not self._assign_slots(req, req.num_computed + length):
                victim = self._pick_victim(exclude=req)
                if victim is None:
                    length = 0
                    break
                self.preempt(victim)
                segments = [s for s in segments if s.req is not victim]
            if length:
                segments.append(Segment(req, req.num_computed, length, draft, tree))
                budget -= length
        return segments, budget

    def _urgent_priority(self) -> int | None:
        """The priority of the first waiting request if it outranks some running request and can be
        admitted now (so pausing the others cannot stall anything)."""
        if not self.waiting or not self.running:
            return None
        head = self.waiting[0]
        if head.priority >= max(r.priority for r in self.running):
            return None
        if len(self.running) >= self.config.max_running_requests or self.req_pool.num_free == 0:
            return None
        need = -(-min(len(head.all_ids), self.config.chunked_prefill_size) // self.page)
        return head.priority if need <= self.available_pages() else None

    def _order_waiting(self) -> None:
        if self.config.schedule_policy == "lpm":
            # Longest prefix match first; priority still dominates.
            lengths = {id(r): len(self.cache.match_prefix(r.all_ids[:-1], r.cache_namespace)[0]) for r in self.waiting}
            self.waiting.sort(key=lambda r: (r.priority, -lengths[id(r)], r.arrival))
        else:
            self.waiting.sort(key=lambda r: (r.priority, r.arrival))

    def _admit(self, req: Request, budget: int, reserve: int) -> Segment | None:
        ids = req.all_ids
        if req.needs_prompt_logits:
            slots, handle = torch.empty(0, dtype=torch.int64), None
        else:
            if self.tier is not None:  # what came from the storage tier joins the radix cache first
                self.tier.load(req.rid, ids[:-1], req.cache_namespace)
            slots, handle = self.cache.match_prefix(ids[:-1], req.cache_namespace)  # leave >= 1 token to compute
            if _whole_images(req, 0, len(slots)) != len(slots):  # a cached prefix ending inside such an image
                slots, handle = torch.empty(0, dtype=torch.int64), None
        prefix = len(slots)
        length = _whole_images(req, prefix, min(len(ids) - prefix, budget))
        if self.snapshots is not None:
            length = self.snapshots.chunk_length(req, prefix, length)
        need = -(-length // self.page)
        # Keep a page per running request in reserve for its next decode step.
        if need + reserve > self.available_pages():
            return None
        # (a cached prefix's window is copied into the request's own window pages)
        if self.windows is not None and need + reserve + (self.windows.window // self.page + 1 if prefix else 0) > (
            self.windows.available_pages()
        ):
            return None
        row = self.req_pool.allocate()
        if row is None:
            return None
        self.cache.lock(handle)
        req.prefix_handle, req.prefix_len = handle, prefix
        req.req_pool_idx, req.own_pages = row, []
        req.num_computed = prefix
        if self.windows is not None:
            wslots = self.windows.cache.window_slots(handle) if prefix else None
            if not self.windows.admit(req, prefix, wslots):
                self._release(req, cache_kv=False)
                return None
        if prefix:
            self.req_pool.write(row, 0, slots)
            if self.states is not None:  # resume from the snapshot at the prefix's end
                self.states.restore(row, handle.state)
        if not req.first_prefill_done:
            req.cached_tokens = prefix
        if not self._assign_slots(req, prefix + length):
            self._release(req, cache_kv=False)
            return None
        req.status = Status.RUNNING
        self.running.append(req)
        if req.first_scheduled is None:  # first admission (a preempted request comes back later)
            req.first_scheduled = time.monotonic()
            self.prefix_cache_queries += len(ids)
            self.prefix_cache_hits += prefix
        return Segment(req, prefix, length)

    def _pick_victim(self, exclude: Request) -> Request | None:
        cands = [r for r in self.running if r is not exclude and r.status is Status.RUNNING]
        if not cands:
            return None
        return max(cands, key=lambda r: (r.priority, r.arrival))

    # -- leaving the running set ---------------------------------------------------------------
    def _release(self, req: Request, cache_kv: bool) -> None:
        """Give back the request's row and pages, handing computed K/V to the prefix cache."""
        row = req.req_pool_idx
        if row is None:
            return
        n = req.num_computed
        own_start = req.prefix_len
        if cache_kv and n > 0:
            ids = req.all_ids[:n]
            slots = self.req_pool.read(row, n)
            wins = self.windows
            if wins is not None and wins.cache is not None:  # the window slots beside (0: given back)
                already = wins.cache.insert(ids, slots, req.cache_namespace, wins.cache_slots(req, n))
            else:
                already = self.cache.insert(ids, slots, req.cache_namespace)
            if self.snapshots is not None:
                self.snapshots.hand_over(req, ids, n)
            if self.tier is not None and req.tier_namespace is not None:
                self.tier.store_prefix(ids, req.tier_namespace, req.cache_namespace)
            aligned = n - n % self.page
            # Pages the cache took over: [max(already, prefix), aligned). Free the rest of ours.
            kept_from = max(already, own_start)
            keep = set(range((kept_from - own_start) // self.page, (aligned - own_start) // self.page))
            self.pool.free(p for i, p in enumerate(req.own_pages) if i not in keep)
            if self.windows is not None:
                self.windows.release(req, (kept_from, aligned))
        else:
            self.pool.free(req.own_pages)
            if self.windows is not None:
                self.windows.release(req)
        for _, snap in req.snapshots:  # (those the cache did not take)
            self.states.free_snapshot(snap)
        req.snapshots = []
        self.cache.unlock(req.prefix_handle)
        self.req_pool.free(row)
        req.req_pool_idx, req.prefix_handle, req.prefix_len, req.own_pages = None, None, 0, []
        req.num_computed = 0

    def finish(self, req: Request, reason: str, matched=None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.matched_stop = matched
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:  # preempted before a deferred stop string was seen
            self.waiting.remove(req)
        self._release(req, cache_kv=True)
        if self.speculator is not None:
            self.speculator.release(req)

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req, cache_kv=True)
        req.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def on_step_done(self, batch: ScheduledBatch) -> None:
        for seg in batch.segments:
            # A draft's K/V counts once its tokens are accepted (the engine moves this on then).
            seg.req.num_computed = seg.start + seg.length - len(seg.draft)
            if not seg.req.first_prefill_done and seg.samples:  # (samples: read once a request)
                seg.req.first_prefill_done = True
        if self.windows is not None:  # the pages the window passed go back before the next admission
            for seg in batch.segments:
                if seg.req.req_pool_idx is not None:
                    self.windows.drop_passed(seg.req)
        if self.snapshots is not None:
            for seg in batch.segments:
                # (a drafted step's state waits for its verification)
                if not seg.draft and seg.req.status is Status.RUNNING:
                    self.snapshots.after_step(seg.req)

    # -- stats -------------------------------------------------------------------------------
    def token_usage(self) -> float:
        used = self.pool.capacity_pages - self.pool.num_free_pages - self.cache.evictable_pages
        return used / max(1, self.pool.capacity_pages)


_RUN_ORDER = operator.attrgetter("priority", "arrival")  # the running requests' order each step
