"""Errors in each API's own shape: OpenAI's ``{"error": {"message", "type", "param", "code"}}``
elsewhere, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages*``.

Both shapes live here, under every API package, so HTTP plumbing (the body cap, the drain, the
key check) can answer in the right shape without importing an API."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _OPENAI_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(status_code=self.status, content=self.body(), headers=headers)


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> JSONResponse:
    return APIError(message, status, param, code).response()


# Anthropic's error types by status; statuses it does not use are mapped onto ones it does.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_ANTHROPIC_STATUS = {415: 400, 422: 400}


def anthropic_error(message: str, status: int = 400) -> JSONResponse:
    status = _ANTHROPIC_STATUS.get(status, status)
    body = {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message},
    }
    return JSONResponse(status_code=status, content=body)


def shaped_error(path: str, message: str, status: int, *, param=None, code=None, headers=None) -> JSONResponse:
    """An error response in the API's own shape: Anthropic's on /v1/messages*, Ollama's on /api/*,
    OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        resp = anthropic_error(message, status)
    elif path.startswith("/api/"):
        resp = JSONResponse(status_code=status, content={"error": message})
    else:
        resp = APIError(message, status, param=param, code=code).response()
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp
