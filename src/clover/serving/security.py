"""Who may call the server, from where, and how much they may send.

- API key: `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's clients send
  that) on every route except `/health` (load balancers probe it) and the web page's static
  files (they hold no data; the page asks for the key and sends it with each API call).
  Every credential header present must carry the key, and a header given twice is refused:
  a proxy that appends its own header must not turn a wrong key into a right one. The check
  compares SHA-256 digests with `hmac.compare_digest`: equal-length inputs and a constant-time
  comparison, so timing reveals neither the key nor its length. An empty key is refused when
  the server starts (`ServeOptions.check`), never read as "no key".
- Browsers: a page on another site must not drive a local server. `HostGuard` refuses a
  `Host` that is not localhost, an IP address, the bound name or one of `--allowed-hosts`
  (a DNS-rebinding page reaches the server under its own domain name), and an `Origin` that
  is neither the server's own nor one of `--cors-origins`. POST bodies must be
  `application/json` (`read_body`, 415 otherwise): a cross-site form or `text/plain` fetch
  cannot send that without a CORS preflight, which gets no permissive answer unless
  `--cors-origins` asks for one.
- Body size: a request's body is read in chunks and refused with 413 as soon as it passes
  the limit (a Content-Length over it is refused before reading anything).
- Nothing from a request is ever unpickled or passed to `torch.load`: bodies are JSON only.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from fastapi import Request

from clover.serving.errors import APIError, send_error

PUBLIC_PATHS = frozenset({"/health", "/", "/favicon.ico"})
PUBLIC_PREFIXES = ("/static/",)
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})


def unauthorized(message: str = "invalid or missing API key") -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _same_key(given: str, expected: bytes) -> bool:
    # the digests are compared whatever was given, so every refusal takes as long
    return hmac.compare_digest(digest(given), expected) and bool(given)


def key_matches(authorization: str | None, expected: bytes) -> bool:
    """Whether an Authorization header carries the key whose digest is `expected`."""
    scheme, _, given = (authorization or "").partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    return _same_key(given, expected)


def check_credentials(headers: list[tuple[bytes, bytes]], expected: bytes) -> APIError | None:
    """None when the request carries the key; else the 401 to answer."""
    auth = [v.decode("latin-1") for k, v in headers if k == b"authorization"]
    keys = [v.decode("latin-1").strip() for k, v in headers if k == b"x-api-key"]
    if len(auth) > 1 or len(keys) > 1:
        return unauthorized("ambiguous credentials: a key header was sent more than once")
    checks = [key_matches(auth[0], expected)] if auth else []
    checks += [_same_key(keys[0], expected)] if keys else []
    return None if checks and all(checks) else unauthorized()


class ApiKeyMiddleware:
    """Raw ASGI: answers 401 before the app sees a request without the right key."""

    def __init__(self, app: Callable, api_key: str) -> None:
        self.app = app
        self.expected = digest(api_key)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or _is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        refused = check_credentials(scope["headers"], self.expected)
        if refused is None:
            await self.app(scope, receive, send)
        else:
            await send_error(send, refused, scope["path"])


def _is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def _host_name(host: str) -> str:
    """A Host header's name, without port or IPv6 brackets, lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGuard:
    """Raw ASGI: refuses (403) a Host or Origin that a page on another site would bring.

    IP-address hosts are always accepted: DNS rebinding needs a domain name, and a request
    that names an address came to it directly. Names must be localhost, the name the server
    was bound to, or listed (`--allowed-hosts`; "*" accepts any, ".example.com" a suffix).
    """

    def __init__(
        self, app: Callable, bound: str, allowed_hosts: tuple[str, ...], cors: tuple[str, ...]
    ) -> None:
        self.app = app
        names = {h.lower() for h in allowed_hosts}
        if not _is_ip(bound) and bound not in ("", "0.0.0.0", "::"):
            names.add(bound.lower())
        self.any_host = "*" in names
        self.names = frozenset(n for n in names if not n.startswith("."))
        self.suffixes = tuple(n for n in names if n.startswith("."))
        self.any_origin = "*" in cors
        self.origins = frozenset(o.rstrip("/").lower() for o in cors)

    def host_ok(self, host: str) -> bool:
        name = _host_name(host)
        if self.any_host or _is_ip(name) or name in LOCAL_NAMES or name.endswith(".localhost"):
            return True
        return name in self.names or name.endswith(self.suffixes)

    def origin_ok(self, origin: str, host: str) -> bool:
        if self.any_origin or origin.rstrip("/").lower() in self.origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        refused = None
        if host and not self.host_ok(host):
            refused = APIError(
                403,
                f"Host {_host_name(host)[:100]!r} is not served here: start the server with "
                "--allowed-hosts to accept it",
                kind="permission_error",
                code="host_not_allowed",
            )
        elif origin is not None and not self.origin_ok(origin.decode("latin-1"), host):
            refused = APIError(
                403,
                "requests from other web origins are refused: start the server with "
                "--cors-origins to allow one",
                kind="permission_error",
                code="origin_not_allowed",
            )
        if refused is None:
            await self.app(scope, receive, send)
        else:
            await send_error(send, refused, scope["path"])


async def read_body(request: Request, limit: int) -> bytes:
    """The JSON request body: 415 unless it is declared as JSON, 413 as soon as it passes
    `limit` bytes."""
    mime = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if mime != "application/json":
        raise APIError(
            415,
            f"Content-Type must be application/json, got {mime[:60] or 'none'}",
            code="unsupported_media_type",
        )
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
