"""The HTTP server's connections, bounded: no client can hold them, or the process's file
descriptors, for free.

`GuardedH11Protocol` is uvicorn's h11 protocol with `ConnectionGuard`'s rules:

- at most `max_connections` open at a time (TLS handshakes included); past it a new connection
  is answered 503 and closed, unless some connection is still unauthenticated: then the oldest
  of those is closed to make room;
- at most `max_unauthenticated` connections that have not yet sent a request with a valid token
  (without a token configured: not yet a complete request); past it, the oldest is closed, so a
  flood of silent connections can neither keep real clients out nor exhaust descriptors;
- a request's headers (and the TLS handshake before them) must arrive within `header_timeout`
  seconds of the connection (a later request's: of its first byte), whatever the pace; a body
  may not stall for more than
  `body_timeout` seconds between bytes (while the app waits for it). Such connections are closed.

When the server closes a connection the client may still be writing to (a request answered
before its body was read: a 401, a 404, a 413), the close lingers: the connection stops
writing, discards what still arrives for up to `LINGER_S` seconds or until the client closes,
then closes. Closing at once would make the kernel answer the late bytes with a reset, which
can destroy the response before the client reads it.

TLS is done here (`loop.start_tls`) rather than by uvicorn, so that a handshake is a counted
connection under the header deadline instead of asyncio's uncounted 60 s.

`RateLimitedLog` keeps a flood of identical errors (asyncio's accept loop failing on every
call, uvicorn's "Invalid HTTP request") to one line per interval, with a count of the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger("tprt.serve")

Headers = list[tuple[bytes, bytes]]
LINGER_S = 2.0


class _LingeringTransport:
    """The transport uvicorn sees: its `close()` lingers (see the module docstring)."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.linger()


@dataclass(frozen=True)
class HttpLimits:
    """--http-header-timeout, --http-body-timeout, --http-max-connections, --http-max-unauthenticated."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 512
    max_unauthenticated: int = 64


class ConnectionGuard:
    """The open connections of one server, oldest first (used on the event loop's thread only)."""

    def __init__(self, limits: HttpLimits, trusted: Callable[[Headers], bool]) -> None:
        self.limits = limits
        self.trusted = trusted  # whether a request's headers carry the token
        self.open: dict[GuardedH11Protocol, None] = {}
        self.untrusted: dict[GuardedH11Protocol, None] = {}
        self.closed = {"refused": 0, "evicted": 0, "header_timeout": 0, "body_timeout": 0}

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Whether `conn` may stay open (closing an older unauthenticated one if it takes its place)."""
        if len(self.open) >= self.limits.max_connections:
            if not self.untrusted:
                self.closed["refused"] += 1
                return False
            self._evict_oldest()
        self.open[conn] = None
        self.untrusted[conn] = None
        if len(self.untrusted) > self.limits.max_unauthenticated:
            self._evict_oldest()
        return True

    def _evict_oldest(self) -> None:
        oldest = next(iter(self.untrusted))
        self.closed["evicted"] += 1
        oldest.close_now()

    def request(self, conn: GuardedH11Protocol, headers: Headers) -> None:
        """A request's headers arrived on `conn`."""
        if conn in self.untrusted and self.trusted(headers):
            del self.untrusted[conn]

    def drop(self, conn: GuardedH11Protocol) -> None:
        self.open.pop(conn, None)
        self.untrusted.pop(conn, None)


_REFUSAL = json.dumps({"error": {"message": "too many open connections (--http-max-connections); retry later",
                                 "type": "server_error", "param": None, "code": None}}).encode()
REFUSED_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n" % len(_REFUSAL)) + _REFUSAL


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ConnectionGuard (see the module docstring)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, guard: ConnectionGuard,
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self.tls = tls
        self.raw: asyncio.Transport | None = None  # the TCP transport, under TLS if any
        self.up = False  # uvicorn's connection_made has run (after the TLS handshake)
        self.early = bytearray()  # what TLS decrypted before start_tls returned
        self.deadline: asyncio.TimerHandle | None = None
        self.waiting_for = ""  # "header" or "body": what the deadline is for
        self.lingering = False  # closing: what arrives is dropped until the client closes or LINGER_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        assert isinstance(transport, asyncio.Transport)
        self.raw = transport
        if not self.guard.admit(self):
            if self.tls is None:
                transport.write(REFUSED_RESPONSE)
                transport.close()
            else:
                transport.abort()
            return
        self._expect("header", self.guard.limits.header_timeout)
        if self.tls is None:
            self.up = True
            super().connection_made(transport)
            self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        else:
            transport.pause_reading()  # the client's hello waits for the TLS layer
            self.loop.create_task(self._handshake(transport, self.tls))

    async def _handshake(self, transport: asyncio.Transport, tls: ssl.SSLContext) -> None:
        try:
            secured = await self.loop.start_tls(transport, self, tls, server_side=True,
                                                ssl_handshake_timeout=self.guard.limits.header_timeout)
        except Exception:  # noqa: BLE001 - a failed handshake is the client's affair: close, say nothing
            transport.abort()
            self._forget()
            return
        if transport.is_closing() or secured is None:
            self._forget()
            return
        self.up = True
        super().connection_made(secured)
        self.transport = _LingeringTransport(secured, self)  # type: ignore[assignment]
        if self.early:
            data, self.early = bytes(self.early), bytearray()
            self.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        if self.up:
            super().connection_lost(exc)

    def _forget(self) -> None:
        self._cancel_deadline()
        self.guard.drop(self)

    def linger(self) -> None:
        """uvicorn's close: stop writing, drop input until the client closes (or LINGER_S)."""
        transport = self.transport._transport if isinstance(self.transport, _LingeringTransport) else self.transport
        if self.lingering or transport.is_closing():
            return
        self.lingering = True
        self._cancel_deadline()
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # the client has gone already (ENOTCONN): nothing to linger for
                transport.close()
                return
        self.loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        if not self.up:  # the request may follow the handshake before start_tls has returned
            self.early += data
            return
        super().data_received(data)
        self._watch()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self.guard.request(self, self.headers)
        self._watch()

    def _watch(self) -> None:
        """Sets the deadline for what the client owes now: the rest of a request's headers (one
        deadline from their first byte), the next bytes of its body, or nothing."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self.waiting_for != "header" and self.conn.trailing_data[0]:
                self._expect("header", self.guard.limits.header_timeout)
        elif state is h11.SEND_BODY:
            self._expect("body", self.guard.limits.body_timeout)
        else:
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _expect(self, what: str, seconds: float) -> None:
        self._cancel_deadline()
        self.waiting_for = what
        self.deadline = self.loop.call_later(seconds, self._late)

    def _cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = None
        self.waiting_for = ""

    def _late(self) -> None:
        what = self.waiting_for
        self.deadline = None
        self.waiting_for = ""
        if what == "body" and self.up and self.flow.read_paused:  # the app is not reading: not the client's delay
            self._expect("body", self.guard.limits.body_timeout)
            return
        self.guard.closed[f"{what}_timeout"] += 1
        self.close_now()

    def close_now(self) -> None:
        """Closes the connection at once (its descriptor is free when this returns to the loop)."""
        self._forget()
        if self.raw is not None:
            self.raw.abort()


_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


class RateLimitedLog(logging.Filter):
    """Lets one record per kind through every `every` seconds; the next one that passes says how
    many were held back. A kind is the logger, the exception's type and the message's first line
    without its numbers (asyncio puts addresses, descriptors and times in them)."""

    def __init__(self, every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every = every
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        first_line = str(record.msg).split("\n", 1)[0]
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key = (f"{record.name} {exc}", _NUMBERS.sub("#", first_line))
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        if len(self._last) > 1000:  # templates are few; bounded all the same
            self._last.clear()
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the last {self.every:g}s were not logged)"
        return True


def install_log_limits(every: float = 10.0) -> RateLimitedLog:
    """Rate-limits asyncio's and uvicorn's error loggers (once per process)."""
    limit = RateLimitedLog(every)
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitedLog) for f in logger.filters):
            logger.addFilter(limit)
    return limit
