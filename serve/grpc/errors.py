"""The serve core's errors (serve/errors.py) as gRPC statuses, by one interceptor around every method.

Handlers never call `context.abort` themselves: they raise. `ErrorInterceptor` wraps every method
(unary and streaming), maps what escapes through `serve.errors.status_of` to the gRPC code of its
`Status` (the same canonical codes), makes the message safe to show (`Redactor`) and reports each
call's outcome (the status's name) to a callback, which the server points at the Prometheus
request counter.

Request bytes that do not parse (serve/grpc/wire.py) reach the handler as an `Undecodable`, answered
with INVALID_ARGUMENT naming the bad field when the bytes show it, and counted like any outcome:
no stack trace per request in the log.

The field at fault of an INVALID_ARGUMENT / OUT_OF_RANGE status is also sent as trailing metadata
`tprt-field`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from serve.errors import MAX_MESSAGE_CHARS, InvalidArgument, Redactor, Status, status_of
from serve.grpc.wire import Undecodable, lenient

log = logging.getLogger("tprt.serve")

FIELD_METADATA_KEY = "tprt-field"

Outcome = Callable[[str, str, float], None]  # (method, status name, seconds)

GRPC_CODES = {s: grpc.StatusCode[s.name] for s in Status}  # the same canonical codes, by name


def refuse_undecodable(request: Any, fn: Any) -> None:
    """InvalidArgument for request bytes that did not parse, unless `fn` refuses every request
    anyway (serve/grpc/auth.py's denial: the missing token is the first thing to say)."""
    if isinstance(request, Undecodable) and not getattr(fn, "refuses_every_request", False):
        what = "not valid UTF-8 text" if request.field else "not a valid serialized message"
        raise InvalidArgument(f"the {request.message} could not be decoded: {what}", request.field or "request")


def _log_and_tag(context: grpc.ServicerContext, method: str, e: Exception,
                 redact: Redactor) -> tuple[Status, str]:
    status, message, field = status_of(e)
    if status == Status.INTERNAL:
        log.exception("%s failed", method)
    else:
        log.debug("%s: %s %s", method, status.name, message)
    if field:
        context.set_trailing_metadata(((FIELD_METADATA_KEY, field[:MAX_MESSAGE_CHARS]),))
    return status, redact(message)


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions to status codes for every method, and reports each call's outcome."""

    def __init__(self, on_outcome: Outcome | None = None, redact: Redactor | None = None) -> None:
        self._on_outcome = on_outcome
        self._redact = redact or Redactor()

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream),
                request_deserializer=lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:  # server reflection: its own messages, parsed as they come
            return grpc.stream_stream_rpc_method_handler(
                self._stream(method, handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _report(self, method: str, status: Status, t0: float) -> None:
        if self._on_outcome is not None:
            self._on_outcome(method, status.outcome, time.perf_counter() - t0)

    def _unary(self, method: str, fn: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.perf_counter()
            try:
                refuse_undecodable(request, fn)
                response = fn(request, context)
            except Exception as e:  # noqa: BLE001 - every exception becomes a status
                status, message = _log_and_tag(context, method, e, self._redact)
                self._report(method, status, t0)
                context.abort(GRPC_CODES[status], message)  # raises: grpc ends the call with this status
            self._report(method, Status.OK, t0)
            return response

        return wrapped

    def _stream(self, method: str, fn: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Any]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            t0 = time.perf_counter()
            status = Status.CANCELLED  # if the generator is closed early (client gone)
            message = ""
            try:
                refuse_undecodable(request, fn)
                yield from fn(request, context)
                status = Status.OK
            except Exception as e:  # noqa: BLE001 - every exception becomes a status
                status, message = _log_and_tag(context, method, e, self._redact)
            finally:
                self._report(method, status, t0)
            if status != Status.OK:
                context.abort(GRPC_CODES[status], message)

        return wrapped
