"""Slow and greedy clients at the socket: a header timeout and a cap on connections per address.

uvicorn closes idle keep-alive connections, but a request whose headers never finish keeps
its socket for good: a client that sends half a request line and waits (or a byte a second)
holds a connection, and enough of them hold the server. `guarded_protocol(limits)` is
uvicorn's h11 protocol with these bounds:

- A request's headers must be complete `header_timeout` seconds after the connection opens
  (or after the previous response ends); its body `body_timeout` seconds after the headers.
  The app answers a late body itself with a 408 (`security.read_body`); the socket-level
  body timer, a second later, closes connections whose body nobody reads.
- At most `per_client` connections from one address at once; one more is answered 429 and
  closed before anything is read. Behind a reverse proxy every connection comes from the
  proxy: there set the cap to 0 (off) and let the proxy bound its clients.

Closing a slow connection is one info line in the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("clover.serve")
BODY_GRACE = 1.0  # seconds the app's own 408 gets before the socket-level body timer


@dataclass
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    per_client: int = 64  # 0: no cap
    open: Counter = field(default_factory=Counter)  # client address -> open connections
    closed_slow: int = 0  # connections closed by a timer (for /metrics)
    refused: int = 0  # connections refused by the cap


def _too_many(limit: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"too many connections from this address: at most {limit} at once",
                "type": "rate_limit_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        f"retry-after: 1\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol under `limits` (pass it as `uvicorn.Config(http=...)`)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._timer: asyncio.TimerHandle | None = None
            self._seen = None  # the request cycle whose headers the timers last saw
            self._address = self.client[0] if self.client else None
            if limits.per_client and self._address is not None:
                if limits.open[self._address] >= limits.per_client:
                    limits.refused += 1
                    self._address = None  # not counted: nothing to give back
                    transport.write(_too_many(limits.per_client))
                    transport.close()
                    return
                limits.open[self._address] += 1
            else:
                self._address = None
            self._arm(limits.header_timeout, "its request headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._address is not None:
                limits.open[self._address] -= 1
                if limits.open[self._address] <= 0:
                    del limits.open[self._address]
                self._address = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._seen = self.cycle
                self._arm(limits.header_timeout, "its next request's headers")
                self._follow()  # a pipelined request may have started already

        def _follow(self) -> None:
            """Move the timer along: headers done -> the body's timer; body done -> none."""
            cycle = self.cycle
            if cycle is None or self.transport.is_closing():
                return
            if cycle is not self._seen:  # a new request's headers are complete
                self._seen = cycle
                if cycle.more_body:
                    self._arm(limits.body_timeout + BODY_GRACE, "its request body")
                else:
                    self._disarm()
            elif not cycle.more_body and not cycle.response_complete:
                self._disarm()

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired, seconds, what)

        def _disarm(self) -> None:
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self, seconds: float, what: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            limits.closed_slow += 1
            client = self.client[0] if self.client else "?"
            log.info("closing a connection from %s: %s took over %g s", client, what, seconds)
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
                    b"content-length: 0\r\n\r\n"
                )
            self.transport.close()

    return GuardedH11Protocol
