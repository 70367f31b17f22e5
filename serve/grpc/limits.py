"""Calls that need no token get a small share of the server, so they cannot starve the rest.

Health checks and watches need no token, nor do calls that are refused for a missing or wrong
one (with --auth-token-file); a health Watch holds a server thread for as long as the client keeps it open. Without a
bound, anyone who can reach the port could hold every thread and make generation and jobs fail.
`OpenCallLimiter` lets at most `max_open` such calls run at a time per kind (unary, streaming):
more are refused at once with RESOURCE_EXHAUSTED, and the server's thread count is sized as
authenticated capacity plus these shares (serve/server.py), so the two never compete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from serve.errors import QueueFull

Trusted = Callable[[Any], bool]  # handler call details -> whether the call carries a valid token


def needs_no_token(method: str) -> bool:
    """Whether `method` is served without a token (health checks)."""
    from serve.grpc.auth import EXEMPT_PREFIXES

    return method.startswith(EXEMPT_PREFIXES)


class OpenCallLimiter(grpc.ServerInterceptor):
    """At most `max_open` unary and `max_open` streaming calls without a valid token at a time."""

    def __init__(self, max_open: int, trusted: Trusted) -> None:
        self.max_open = max_open
        self._trusted = trusted
        self._unary = threading.BoundedSemaphore(max_open)
        self._streams = threading.BoundedSemaphore(max_open)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or (not needs_no_token(details.method) and self._trusted(details)):
            return handler
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary_call(handler.unary_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._stream_call(handler.unary_stream), **kw)
        if handler.stream_stream is not None:  # server reflection
            return grpc.stream_stream_rpc_method_handler(self._stream_call(handler.stream_stream), **kw)
        return handler

    def _refuse(self) -> None:
        raise QueueFull(f"too many calls without a token in flight (at most {self.max_open} of each kind; "
                        "--max-open-calls)")

    # The share is taken when the call's handler runs (on a server thread) and given back when it
    # ends, whatever the reason, so a call cancelled before it ran holds nothing.

    def _unary_call(self, fn: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            if not self._unary.acquire(blocking=False):
                self._refuse()
            try:
                return fn(request, context)
            finally:
                self._unary.release()

        return call

    def _stream_call(self, fn: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Iterator[Any]]:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not self._streams.acquire(blocking=False):
                self._refuse()
            try:
                yield from fn(request, context) or ()
            finally:
                self._streams.release()

        return call
