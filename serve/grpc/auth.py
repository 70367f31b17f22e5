"""gRPC's bearer-token check: every method but the health check needs `authorization: Bearer <token>`
(serve/auth.py reads the token). A refused call raises `Unauthenticated` inside the method
handler, so the error interceptor (outermost, serve/grpc/errors.py) gives it its status and counts
it like any other outcome."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

from serve.auth import bearer
from serve.errors import Unauthenticated

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the right bearer token (health checks exempt)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def authenticated(self, details: Any) -> bool:
        """Whether the call carries the right bearer token."""
        got = bearer(details.invocation_metadata)
        return got is not None and hmac.compare_digest(got.encode(), self._token)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES) or self.authenticated(details):
            return handler
        why = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            raise Unauthenticated(why)

        def deny_stream(request: Any, context: grpc.ServicerContext) -> Any:
            raise Unauthenticated(why)
            yield  # a generator, like the method it replaces

        deny.refuses_every_request = deny_stream.refuses_every_request = True  # type: ignore[attr-defined]

        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
