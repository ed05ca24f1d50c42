"""Who may call the server, from where, and how much and how slowly they may send.

- API keys: `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's clients send
  that) on every route except `/health` (load balancers probe it) and the web page's static
  files (they hold no data; the page asks for the key and sends it with each API call).
  Each key belongs to a tenant (`tenants.KeyRing`), which the request carries on from here
  (`scope["clover.tenant"]`). Every credential header present must carry the same valid key,
  and a header given twice is refused: a proxy that appends its own header must not turn a
  wrong key into a right one. Keys are looked up by their SHA-256 digest, so timing reveals
  neither a key nor how much of one a guess shares. An empty key is refused when the server
  starts (`ServeOptions.check`), never read as "no key".
- Browsers: a page on another site must not drive a local server. `HostGuard` refuses a
  `Host` that is not localhost, an IP address, the bound name or one of `--allowed-hosts`
  (a DNS-rebinding page reaches the server under its own domain name), and an `Origin` that
  is neither the server's own nor one of `--cors-origins`. Host is parsed as `host[:port]`
  (RFC 3986: a DNS name, an IPv4 address or a bracketed IPv6 one, and a numeric port), so
  `localhost:80@evil.com` is no Host at all; a Host or Origin header sent twice is refused
  (which one a check reads must not be a choice). POST bodies must be `application/json`
  (`read_body`, 415 otherwise): a cross-site form or `text/plain` fetch cannot send that
  without a CORS preflight, which gets no permissive answer unless `--cors-origins` asks.
- Body size and pace: a request's body is read in chunks and refused with 413 as soon as it
  passes the limit (a Content-Length over it is refused before reading anything), and with
  408 if it has not all arrived `--body-timeout` seconds after the headers (a client sending
  a byte a second holds a connection no longer). A client that hangs up mid-body is one
  info line in the log. The socket-level limits (header timeout, connections per client)
  are in `connections.py`.
- Nothing from a request is ever unpickled or passed to `torch.load`: bodies are JSON only.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
from collections.abc import Callable
from urllib.parse import urlsplit

from fastapi import Request
from starlette.requests import ClientDisconnect

from clover.serving.errors import APIError, bad_request, send_error
from clover.serving.tenants import KeyRing, Tenant, digest

PUBLIC_PATHS = frozenset({"/health", "/", "/favicon.ico"})
PUBLIC_PREFIXES = ("/static/",)
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})
TENANT = "clover.tenant"  # the scope key of the request's tenant
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_REG_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_PORT = re.compile(r"[0-9]{1,5}")
log = logging.getLogger("clover.serve")

__all__ = ["TENANT", "ApiKeyMiddleware", "HostGuard", "digest", "parse_host", "read_body"]


def unauthorized(message: str = "invalid or missing API key") -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _same_key(given: str, expected: bytes) -> bool:
    # the digests are compared whatever was given, so every refusal takes as long
    return hmac.compare_digest(digest(given), expected) and bool(given)


def bearer(authorization: str | None) -> str:
    """The key of an `Authorization: Bearer <key>` header ("" for any other scheme)."""
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""


def key_matches(authorization: str | None, expected: bytes) -> bool:
    """Whether an Authorization header carries the key whose digest is `expected`."""
    return _same_key(bearer(authorization), expected)


def check_credentials(headers: list[tuple[bytes, bytes]], keys: KeyRing) -> Tenant | APIError:
    """The request's tenant, or the 401 to answer."""
    auth = [v.decode("latin-1") for k, v in headers if k == b"authorization"]
    given = [v.decode("latin-1").strip() for k, v in headers if k == b"x-api-key"]
    if len(auth) > 1 or len(given) > 1:
        return unauthorized("ambiguous credentials: a key header was sent more than once")
    given += [bearer(a) for a in auth]
    if not given or len(set(given)) > 1:  # none, or two headers with different keys
        return unauthorized()
    tenant = keys.tenant(given[0])
    return tenant if tenant is not None else unauthorized()


class ApiKeyMiddleware:
    """Raw ASGI: answers 401 before the app sees a request without a valid key, and puts the
    key's tenant into the scope."""

    def __init__(self, app: Callable, keys: KeyRing) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or _is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        found = check_credentials(scope["headers"], self.keys)
        if isinstance(found, APIError):
            await send_error(send, found, scope["path"])
            return
        scope[TENANT] = found
        await self.app(scope, receive, send)


def _is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def parse_host(value: str) -> str | None:
    """A Host header's host, lowercased, without port, brackets or a trailing dot; None when
    the value is not `host[:port]`."""
    if value.startswith("["):  # an IPv6 literal
        end = value.find("]")
        name, rest = (value[1:end], value[end + 1 :]) if end > 0 else ("", "")
        if not name or ":" not in name or not _is_ip(name):
            return None
    else:
        name, colon, port = value.partition(":")
        rest = colon + port
        if not _REG_NAME.fullmatch(name):
            return None
    if rest and not (rest.startswith(":") and _PORT.fullmatch(rest[1:]) and int(rest[1:]) < 65536):
        return None
    return name.lower().rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGuard:
    """Raw ASGI: refuses (403) a Host or Origin that a page on another site would bring, and
    (400) a Host that is not one, or a Host or Origin header sent twice.

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

    def host_ok(self, name: str) -> bool:
        """Whether a parsed host name (`parse_host`) is served here."""
        if self.any_host or _is_ip(name) or name in LOCAL_NAMES or name.endswith(".localhost"):
            return True
        return name in self.names or name.endswith(self.suffixes)

    def origin_ok(self, origin: str, host: str) -> bool:
        if self.any_origin or origin.rstrip("/").lower() in self.origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()

    def check(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
        """None when the request may go on; else the error to answer."""
        hosts = [v.decode("latin-1") for k, v in headers if k == b"host"]
        origins = [v.decode("latin-1") for k, v in headers if k == b"origin"]
        for name, values in (("Host", hosts), ("Origin", origins)):
            if len(values) > 1:
                return bad_request(
                    f"the {name} header was sent {len(values)} times; send it once",
                    code="duplicate_header",
                )
        host = hosts[0] if hosts else ""
        if host:
            name = parse_host(host)
            if name is None:
                return bad_request(
                    f"Host {host[:100]!r} is not a host name with an optional port",
                    code="invalid_host",
                )
            if not self.host_ok(name):
                return APIError(
                    403,
                    f"Host {name[:100]!r} is not served here: start the server with "
                    "--allowed-hosts to accept it",
                    kind="permission_error",
                    code="host_not_allowed",
                )
        if origins and not self.origin_ok(origins[0], host):
            return APIError(
                403,
                "requests from other web origins are refused: start the server with "
                "--cors-origins to allow one",
                kind="permission_error",
                code="origin_not_allowed",
            )
        return None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.check(scope["headers"])
        if refused is None:
            await self.app(scope, receive, send)
        else:
            await send_error(send, refused, scope["path"])


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The JSON request body: 415 unless it is declared as JSON, 413 as soon as it passes
    `limit` bytes, 408 unless it has all arrived within `timeout` seconds. A client that
    hangs up meanwhile is logged in one line and answered 499 (to nobody)."""
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
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        client = request.client.host if request.client else "?"
        log.info("%s hung up while sending a body for %s", client, request.url.path[:100])
        raise APIError(499, "the client closed the connection", code="client_closed") from None
    return b"".join(chunks)
