"""Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see goes through `APIError`, so the body shape and status code are
decided in one place. Messages are written for the client: they name the field and the limit,
and never carry a traceback, an exception's repr or a path on the server (unexpected failures
become a generic 500 whose details go only to the server's log).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """A request failed; `response()` is what the client receives."""

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

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object; `kind` is its "type" field."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return APIError(503, message, kind="server_error", code=code, headers=headers)


def internal_error() -> APIError:
    return APIError(500, "internal server error", kind="server_error", code="internal_error")
