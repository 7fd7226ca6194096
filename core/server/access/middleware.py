"""The key check and the per-key request limit, as plain ASGI middleware (Starlette's
BaseHTTPMiddleware would hide client disconnects from the endpoints, which need them to abort
generation)."""

from __future__ import annotations

from llmkit.core.server.access.keys import APIKey, KeyRing
from llmkit.core.server.access.owners import ANONYMOUS, SCOPE_KEY, Principal, current_cache_scope
from llmkit.core.server.access.rate_limits import RateLimiter, current_limiter
from llmkit.core.server.errors import anthropic_error, error_response, shaped_error


class AccessMiddleware:
    """Finds the caller (``keys`` None: the anonymous one of a server without keys), refuses a
    missing or unknown key with a 401 and a caller over its request rate with a 429, and leaves
    the caller in the scope (:func:`~llmkit.core.server.access.owners.principal`) and its limiter
    in :data:`current_limiter` for the handlers."""

    def __init__(
        self,
        app,
        keys: KeyRing | None,
        rpm: int = 0,
        tpm: int = 0,
        open_exact: frozenset[str] = frozenset(),
        open_prefixes: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.keys = keys
        self.rpm, self.tpm = rpm, tpm
        self.open_exact = open_exact
        self.open_prefixes = open_prefixes  # only the playground's static-file folder
        self.limiters: dict[str | None, RateLimiter] = {}

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or path in self.open_exact
            or (self.open_prefixes and path.startswith(self.open_prefixes))
        ):
            return await self.app(scope, receive, send)
        caller, key = ANONYMOUS, None
        if self.keys is not None:
            key = self._key(scope)
            if key is None:
                if path.startswith("/v1/messages"):
                    resp = anthropic_error("invalid x-api-key", 401)
                else:
                    resp = error_response("Unauthorized: a valid API key is required", 401, code="invalid_api_key")
                return await resp(scope, receive, send)
            caller = Principal(key.owner, key.admin)
        limiter = self._limiter(caller, key)
        if limiter is not None and (refused := limiter.admit()) is not None:
            seconds, why = refused
            message = f"Rate limit reached: this key may make {why}; retry in {seconds} s"
            resp = shaped_error(path, message, 429, code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})
            return await resp(scope, receive, send)
        token = current_limiter.set(limiter)
        cache_token = current_cache_scope.set(key.cache_scope if key is not None else None)
        try:
            await self.app({**scope, SCOPE_KEY: caller}, receive, send)
        finally:
            current_cache_scope.reset(cache_token)
            current_limiter.reset(token)

    def _key(self, scope) -> APIKey | None:
        auth, x_key = "", ""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                auth = value.decode("latin-1")
            elif name == b"x-api-key":  # Anthropic's clients send the key this way
                x_key = value.decode("latin-1")
        bearer = auth[7:] if auth[:7].lower() == "bearer " else ""
        # Both are matched against every key, so the time taken depends on neither.
        by_bearer, by_header = self.keys.match(bearer), self.keys.match(x_key)
        return by_bearer or by_header

    def _limiter(self, caller: Principal, key: APIKey | None) -> RateLimiter | None:
        rpm = key.rpm if key is not None and key.rpm is not None else self.rpm
        tpm = key.tpm if key is not None and key.tpm is not None else self.tpm
        if not rpm and not tpm:
            return None
        if caller.owner not in self.limiters:
            self.limiters[caller.owner] = RateLimiter(rpm, tpm)
        return self.limiters[caller.owner]
