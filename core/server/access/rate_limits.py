"""Per-key rate limits: requests per minute and tokens per minute, as token buckets.

A bucket holds up to a minute's allowance and refills continuously, so a key may burst its whole
minute at once and then goes at the steady rate. Requests are counted when they arrive (every
request the key makes, whatever the route). Tokens are counted when a generation finishes, as the
engine reports them (prompt + completion tokens), since the answer's length is not known before,
and when an embedding, rerank or score request is answered (the tokens of its inputs):
a request is admitted while the key's token bucket is not empty, so one long request may overdraw
it, and the key's next requests wait until it has refilled.
"""

from __future__ import annotations

import math
import time
from contextvars import ContextVar


class Bucket:
    def __init__(self, per_minute: int, clock=time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # per second
        self.level = self.capacity
        self.clock = clock
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, need: float) -> float:
        """Seconds until the bucket holds ``need`` (0: now)."""
        self._refill()
        return max(0.0, (need - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount  # may go below zero: a debt paid back before the next admission


class RateLimiter:
    """One key's limits; 0 or None is no limit. Single-threaded (the server's event loop)."""

    def __init__(self, rpm: int | None, tpm: int | None, clock=time.monotonic) -> None:
        self.rpm = rpm or 0
        self.tpm = tpm or 0
        self.requests = Bucket(self.rpm, clock) if self.rpm else None
        self.tokens = Bucket(self.tpm, clock) if self.tpm else None

    def admit(self) -> tuple[int, str] | None:
        """Take one request, or return ``(Retry-After seconds, why)`` and take nothing."""
        waits = []
        if self.requests is not None and (w := self.requests.wait(1)) > 0:
            waits.append((w, f"{self.rpm} requests per minute"))
        if self.tokens is not None and (w := self.tokens.wait(0)) > 0:
            waits.append((w, f"{self.tpm} tokens per minute"))
        if waits:
            seconds, why = max(waits)
            return max(1, math.ceil(seconds)), why
        if self.requests is not None:
            self.requests.take(1)
        return None

    def charge(self, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.take(tokens)


# The caller's limiter for the request being served: the engine's outputs are charged to it.
current_limiter: ContextVar[RateLimiter | None] = ContextVar("llmkit_rate_limiter", default=None)
