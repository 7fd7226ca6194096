"""SGLang-style step logs: "Prefill batch." on every prefill, "Decode batch." every N decode steps."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("llmkit")


class EngineStats:
    def __init__(self, decode_log_interval: int) -> None:
        self.decode_log_interval = decode_log_interval
        self._decode_tokens = 0
        self._decode_since = time.monotonic()
        self._decode_steps = 0
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0

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
            log.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                "#queue-req: %d",
                len(sched.running),
                n_tok,
                sched.token_usage(),
                tps,
                len(sched.waiting),
            )
            self._decode_tokens, self._decode_steps, self._decode_since = 0, 0, now
