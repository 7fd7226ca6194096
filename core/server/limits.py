"""HTTP-level limits that hold for every route: the request body cap, and errors in one shape.

The body cap is plain ASGI middleware wrapping ``receive``, so it is enforced while the body is
read, whichever way a route reads it (``read_json``, a multipart form, FastAPI's own body
parsing), and a declared ``Content-Length`` over the cap is refused before any of it is read.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmkit.core.server.errors import APIError, shaped_error

log = logging.getLogger("llmkit")
UPLOAD_PATH = "/v1/files"  # batch input files are larger than request bodies (OpenAI: 200 MB)


class PayloadTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"Payload Too Large: the request body is over the limit of {limit} bytes (--max-payload-size)",
            status=413,
            code="payload_too_large",
        )


class BodyLimitMiddleware:
    """Refuse bodies over ``limit`` bytes (``upload_limit`` for file uploads) with a 413."""

    def __init__(self, app, limit: int, upload_limit: int) -> None:
        self.app = app
        self.limit = limit
        self.upload_limit = upload_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.upload_limit if scope["path"] == UPLOAD_PATH else self.limit
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    resp = shaped_error(scope["path"], PayloadTooLarge(limit).message, 413, code="payload_too_large")
                    return await resp(scope, receive, send)
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(limit)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except PayloadTooLarge as exc:  # raised where no exception handler sees it (a form parser)
            if started:
                raise
            await shaped_error(scope["path"], exc.message, 413, code=exc.code)(scope, receive, send)


class InternalErrorMiddleware:
    """An exception no handler took is logged and answered with a 500 in the API's shape, and
    ends here, so the keep-alive connection it came on stays usable.

    Starlette's own 500 handler (``ServerErrorMiddleware``) sends its response and then raises the
    exception again, for the server to log; uvicorn, seeing an app raise after its response
    started, closes the connection, and the client's next request on it failed with a reset. An
    exception after the response started but before it ended (a stream cut short) still goes on:
    that response cannot be completed, and a closed connection is how its client learns so."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = ended = False

        async def tracking_send(message):
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unhandled error on %s", scope["path"])
            if ended:  # the client has its whole response: nothing to tell it
                return
            if started:
                raise
            resp = shaped_error(scope["path"], f"Internal server error: {type(exc).__name__}", 500)
            await resp(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """FastAPI's own errors (404 unknown route, 405 wrong method, 422 validation) and unhandled
    exceptions (500) in the API's shape. Call it after the app's other middleware is added: the
    500s' middleware goes outermost, so it answers for the others too."""
    app.add_middleware(InternalErrorMiddleware)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        cause = exc.__cause__
        if isinstance(cause, APIError):  # FastAPI wraps errors raised while it reads a body
            return shaped_error(request.url.path, cause.message, cause.status, param=cause.param, code=cause.code)
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"Not Found: no route {request.method} {request.url.path}"
        return shaped_error(request.url.path, detail, exc.status_code, code=code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        err = errors[0] if errors else {}
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg", "invalid request"))
        return shaped_error(request.url.path, message, 400, param=param)


def default_max_connections() -> int:
    """Open connections the server accepts: the process's descriptor limit less room for model
    files, logs and the engine's sockets (a connection over the limit fails for the server, not
    for its client), at most 16,384."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 16384
    return max(16, min(16384, soft - 256))


def header_timeout_protocol(seconds: float, max_connections: int | None = None):
    """uvicorn's h11 protocol with a deadline for each request's headers.

    uvicorn times out only idle keep-alive connections between requests: a client that opens a
    connection and then sends nothing, or sends its headers a byte at a time, holds a descriptor
    for as long as it likes (1,200 such connections held 1,200 descriptors). Here every request's
    headers must be complete within ``seconds`` of its first byte (of the connection, for the first
    request), or the connection is closed. Beyond ``max_connections`` open connections a new one
    is closed at once, so connections alone can never exhaust the server's descriptors.
    """
    cap = max_connections or default_max_connections()
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.server_state.connections) > cap:
                transport.close()  # connection_lost forgets it
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's headers arrived whole
                self._disarm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol
