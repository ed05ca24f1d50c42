"""Who may call the server, and how much they may send.

- API key: `Authorization: Bearer <key>` on every route except `/health` (load balancers probe
  it) and the web page's static files (they hold no data; the page asks for the key and
  sends it with each API call). The check compares SHA-256 digests with `hmac.compare_digest`:
  equal-length inputs and a constant-time comparison, so timing reveals neither the key nor
  its length. It runs as raw ASGI middleware, before any body is read.
- Body size: a request's body is read in chunks and refused with 413 as soon as it passes
  the limit (a Content-Length over it is refused before reading anything).
- Nothing from a request is ever unpickled or passed to `torch.load`: bodies are JSON only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable

from fastapi import Request

from clover.serving.errors import APIError, error_body

PUBLIC_PATHS = frozenset({"/health", "/", "/favicon.ico"})
PUBLIC_PREFIXES = ("/static/",)
UNAUTHORIZED = error_body(
    "invalid or missing API key", "invalid_request_error", None, "invalid_api_key"
)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_matches(authorization: str | None, expected: bytes) -> bool:
    """Whether an Authorization header carries the key whose digest is `expected`."""
    scheme, _, given = (authorization or "").partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    # the digests are compared whatever the header held, so every refusal takes as long
    return hmac.compare_digest(digest(given), expected) and bool(given)


class ApiKeyMiddleware:
    """Raw ASGI: answers 401 before the app sees a request without the right key."""

    def __init__(self, app: Callable, api_key: str) -> None:
        self.app = app
        self.expected = digest(api_key)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or _is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if key_matches(auth, self.expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(UNAUTHORIZED).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 as soon as it passes `limit` bytes."""
    too_large = APIError(
        413, f"request body over the limit of {limit} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
