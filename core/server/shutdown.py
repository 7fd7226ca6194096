"""Graceful shutdown: drain on SIGTERM, answer what is left, exit at once on a second signal.

uvicorn's own graceful shutdown closes the listening socket first (so ``/health`` cannot say the
server is draining) and, when its timeout runs out, cancels what is left: non-streaming requests
get a plain-text 500 and streams stop without an error or ``[DONE]``. Here the first SIGTERM (or
SIGINT) only marks the server draining: ``/health`` answers 503 so load balancers stop sending,
new API requests get 503, and in-flight ones run on. When they are done, or ``--shutdown-timeout``
runs out, those left are answered (503 in OpenAI's shape, or a final error event and ``[DONE]``)
and uvicorn is told to exit. A second signal exits the process at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from llmkit.core.server.errors import APIError, shaped_error

log = logging.getLogger("llmkit")
OPEN_WHILE_DRAINING = frozenset({"/health", "/health_generate"})
FLUSH_S = 1.0  # time for the answers of aborted requests to reach their clients


def shutting_down() -> APIError:
    return APIError("the server is shutting down; retry on another instance", status=503, code="server_shutting_down")


class DrainMiddleware:
    """While draining, new requests (except the health checks) get 503; running ones go on."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.state.client.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            exc = shutting_down()
            resp = shaped_error(scope["path"], exc.message, 503, code=exc.code, headers={"Connection": "close"})
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def make_server(config, state, shutdown_timeout: float):
    """A ``uvicorn.Server`` that drains as described above."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        _drain_task: asyncio.Task | bool | None = None

        def handle_exit(self, sig: int, frame) -> None:
            if self._drain_task is not None or self.should_exit:
                log.warning("second %s: exiting now", signal.Signals(sig).name)
                os._exit(1)  # batches are checkpointed per line, so nothing is lost
            log.info(
                "%s: draining (new requests get 503, /health 503); waiting up to %s s for %d in-flight requests",
                signal.Signals(sig).name,
                shutdown_timeout,
                len(state.in_flight),
            )
            state.client.draining = True
            loop = asyncio.get_event_loop()
            self._drain_task = True  # a signal handler may run anywhere in the loop: start from the loop
            loop.call_soon_threadsafe(lambda: setattr(self, "_drain_task", loop.create_task(self._drain())))

        async def _drain(self) -> None:
            await drain(state, shutdown_timeout)
            self.should_exit = True

    return DrainingServer(config)


async def drain(state, timeout: float) -> None:
    """Wait for in-flight requests; when ``timeout`` runs out, answer those left with 503."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    left = list(state.in_flight)
    if left:
        log.warning("shutdown timeout (%s s): answering %d in-flight requests with 503", timeout, len(left))
        for gen in left:
            gen.fail(shutting_down())
        await asyncio.sleep(FLUSH_S)
