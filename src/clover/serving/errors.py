"""Errors in each API's own shape, decided in one place.

Every failure a client can see goes through `APIError`; `body(api)` renders it for the API
the request spoke:

- "openai" (chat/completions, completions, Responses, everything else):
  `{"error": {"message", "type", "param", "code"}}`, `code` a string or null.
- "anthropic" (`/v1/messages`): `{"type": "error", "error": {"type", "message"}}`, whose
  `type` follows from the status (`ANTHROPIC_TYPES`).
- "ollama" (`/api/...`): `{"error": message}`.

`api_for_path` picks the shape from the request path, so middleware that answers before a
route runs (401, Host/Origin refusals, 500s) speaks the same shape as the route would.
Messages are written for the client: they name the field and the limit, and never carry a
traceback, an exception's repr or a path on the server (unexpected failures become a generic
500 whose details go only to the server's log).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

ANTHROPIC_PATHS = ("/v1/messages",)
OLLAMA_PATHS = ("/api/",)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "overloaded_error",
}


def api_for_path(path: str) -> str:
    if path.startswith(ANTHROPIC_PATHS):
        return "anthropic"
    return "ollama" if path.startswith(OLLAMA_PATHS) else "openai"


class APIError(Exception):
    """A request failed; `response(api)` is what the client receives."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.kind, self.param, self.code = kind, param, code
        self.headers = headers or {}

    def body(self, api: str = "openai") -> dict[str, Any]:
        if api == "anthropic":
            kind = ANTHROPIC_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        if api == "ollama":
            return {"error": self.message}
        return error_body(self.message, self.kind, self.param, self.code)

    def response(self, api: str = "openai") -> JSONResponse:
        return JSONResponse(self.body(api), status_code=self.status, headers=self.headers)


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object; `kind` is its "type" field."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    """A 400; every error carries a string `code` (OpenAI's own use null for some, which
    clients cannot branch on)."""
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return APIError(503, message, kind="server_error", code=code, headers=headers)


def internal_error() -> APIError:
    return APIError(500, "internal server error", kind="server_error", code="internal_error")


async def send_error(send: Any, error: APIError, path: str) -> None:
    """Answer a raw ASGI request with `error` (for middleware, before any route runs)."""
    response = error.response(api_for_path(path))
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})
