"""The engine's counters (/get_server_info, /metrics) and SGLang-style step logs: "Prefill batch."
on every prefill, "Decode batch." every N decode steps."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("llmkit")


def engine_counters(engine) -> dict:
    """The counters of ``engine`` (an ``Engine``); ``kv_pages_in_use`` is 0 whenever nothing runs."""
    sched = engine.scheduler
    pool, cache = sched.pool, sched.cache
    free, cached = pool.num_free_pages, cache.evictable_pages
    return {
        "num_running_reqs": len(sched.running),
        "num_waiting_reqs": len(sched.waiting),
        "kv_pages_total": pool.capacity_pages,
        "kv_pages_free": free,
        "kv_pages_cached": cached,
        "kv_pages_in_use": pool.capacity_pages - free - cached,
        "page_size": pool.page_size,
        "kv_cache_dtype": str(pool.dtype).removeprefix("torch."),
        "steps": engine.steps,
        "last_step_age_s": time.monotonic() - engine.last_step,
        "preemptions": sched.num_preemptions,
        "overlap_schedule": engine.overlap,
        "device": engine.runner.device.type,
        "token_usage": sched.token_usage(),
        "prefix_cache_queries": sched.prefix_cache_queries,
        "prefix_cache_hits": sched.prefix_cache_hits,
        **(engine.speculator.stats.as_dict() if engine.speculator is not None else {}),
        **(state_counters(sched) if sched.states is not None else {}),
        **(window_counters(sched.windows) if sched.windows is not None else {}),
        **(sched.tier.stats() if sched.tier is not None else {}),
    }


def window_counters(windows) -> dict:
    """The window layers' own pages (``core/kvcache/window_pages.py``), counted as the full
    layers' are: ``kv_window_pages_in_use`` is 0 whenever nothing runs."""
    free, cached = windows.num_free_pages, windows.evictable_pages
    return {
        "kv_window_pages_total": windows.capacity_pages,
        "kv_window_pages_free": free,
        "kv_window_pages_cached": cached,
        "kv_window_pages_in_use": windows.capacity_pages - free - cached,
        "kv_window": windows.window,
    }


def state_counters(sched) -> dict:
    """A hybrid model's state slots: the running requests' (two each) and the snapshots held by
    the prefix cache or by running requests until they leave."""
    states = sched.states
    held = sum(len(r.snapshots) for r in sched.running)
    used = states.num_snapshots - states.num_free_snapshots
    return {
        "state_slots_running": 2 * len(sched.running),
        "state_slots_total": 2 * states.rows,
        "state_snapshots_total": states.num_snapshots,
        "state_snapshots_cached": used - held,
        "state_snapshots_in_use": used,
        "state_slot_bytes": states.bytes_per_slot(),
    }


class EngineStats:
    def __init__(self, decode_log_interval: int) -> None:
        self.decode_log_interval = decode_log_interval
        self._decode_tokens = 0
        self._decode_since = time.monotonic()
        self._decode_steps = 0
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0
        self._spec_since = (0, 0)  # (verify steps, accepted tokens) at the last decode log line

    def on_step(self, batch, sched, n_decode: int) -> None:
        """``n_decode``: the step's decode tokens, counted before they were appended."""
        if batch.num_new_prefill_seqs:
            self._prompt_tokens_total += batch.num_prefill_tokens + batch.num_cached_tokens
            self._cached_tokens_total += batch.num_cached_tokens
            rate = 100.0 * self._cached_tokens_total / max(1, self._prompt_tokens_total)
            log.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.2f%%, "
                "token usage: %.2f, #running-req: %d, #queue-req: %d",
                batch.num_new_prefill_seqs,
                batch.num_prefill_tokens,
                batch.num_cached_tokens,
                rate,
                sched.token_usage(),
                batch.num_running_before,
                len(sched.waiting),
            )
        self._decode_tokens += n_decode
        if n_decode:
            self._decode_steps += 1
        if self._decode_steps >= self.decode_log_interval:
            now = time.monotonic()
            tps = self._decode_tokens / max(1e-9, now - self._decode_since)
            n_tok = sum(r.seq_len for r in sched.running)
            spec = ""
            if sched.speculator is not None:  # as SGLang's line: tokens a verify step emitted, lately
                s = sched.speculator.stats
                steps, accepted = s.verify_steps - self._spec_since[0], s.accepted_tokens - self._spec_since[1]
                spec = f", accept len: {(accepted + steps) / steps if steps else 0.0:.2f}"
                self._spec_since = (s.verify_steps, s.accepted_tokens)
            log.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                "#queue-req: %d%s",
                len(sched.running),
                n_tok,
                sched.token_usage(),
                tps,
                len(sched.waiting),
                spec,
            )
            self._decode_tokens, self._decode_steps, self._decode_since = 0, 0, now
