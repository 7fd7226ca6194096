"""Build a model's runtime on the thread that will run it.

Each thread that enters an OpenMP parallel region gets a team of its own. A model loaded on one
thread (its weights packed, reordered, quantized: parallel regions) and run on another leaves two
teams on the cores; libgomp then counts more threads than cores, stops spinning between regions,
and every region of every forward pays a futex wake-up. Measured on the 2-core machine: the
embedded model's single-stream decode steps 1.4-2x slower (12-14 -> 19-26 ms), and a short input
to all-MiniLM-L6-v2 5.7 ms a forward against 3.4 ms. So the generation engine and the embedding
engine both build and run on one thread of their own.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def build_and_run(name: str, build: Callable[[], T], run: Callable[[T], None]) -> T:
    """On a new daemon thread named ``name``: ``built = build()``, then ``run(built)`` until it
    returns. Returns ``built`` as soon as it exists, or re-raises what ``build`` raised."""
    box: queue.SimpleQueue = queue.SimpleQueue()

    def main() -> None:
        try:
            built = build()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, which re-raises it)
            box.put((False, exc))
            return
        box.put((True, built))
        run(built)

    threading.Thread(target=main, name=name, daemon=True).start()
    ok, got = box.get()
    if not ok:
        raise got
    return got


class ThreadClient:
    """What the server's plumbing asks of an engine that serves on one thread of its own (the
    embedding and speech engines): liveness, a stuck request's age for ``/health``, no prefix
    cache. The engine sets ``_thread``, ``_stopped`` and ``_busy_since`` (the monotonic time its
    current work began, None when idle); ``thread_role`` names it in the dead message."""

    thread_role = "worker"
    _thread: threading.Thread
    _stopped: bool = False
    _busy_since: float | None = None

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def dead(self) -> str | None:
        return None if self._stopped or self._thread.is_alive() else f"the {self.thread_role} thread stopped"

    def degraded(self) -> str | None:
        return None

    def progress_age(self) -> float:
        """Seconds the current work has run (0 when idle): /health turns 503 on a stuck one."""
        started = self._busy_since
        return 0.0 if started is None else time.monotonic() - started

    async def flush_cache(self) -> bool:
        return True  # no prefix cache: nothing to drop
