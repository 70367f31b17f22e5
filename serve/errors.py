"""Errors the server raises, and the one interceptor that turns every exception into a gRPC status.

Handlers never call `context.abort` themselves: they raise. `ErrorInterceptor` wraps every method
(unary and streaming) and maps what escapes:

    ServeError subclasses          -> their own code (INVALID_ARGUMENT, NOT_FOUND, OUT_OF_RANGE, ...)
    tprt.errors.ValidationError    -> INVALID_ARGUMENT naming the field
    a full disk (ENOSPC, EDQUOT,   -> RESOURCE_EXHAUSTED (HTTP 507, InsufficientStorage): a write
      SQLite's SQLITE_FULL)           that does not fit is refused, the server goes on
    anything else                  -> INTERNAL, logged with its traceback (a server bug, never a
                                      client mistake)

Request bytes that do not parse (serve/grpc/wire.py) reach the handler as an `Undecodable`, answered
with INVALID_ARGUMENT naming the bad field when the bytes show it, and counted like any outcome:
no stack trace per request in the log.

Status messages are safe to show (`Redactor`): the server's own directories become names relative
to them (`--data-dir`'s `jobs/job-.../dataset.jsonl`), any other absolute path its last component,
IP addresses `<address>`, and the whole is cut to MAX_MESSAGE_CHARS; callers' values are quoted
through `echo` (cut to ECHO_CHARS). The full message goes to the server log (debug level).

An INVALID_ARGUMENT / OUT_OF_RANGE status message starts with the field's path
(e.g. "sampling.top_p: ...") and the field is also sent as trailing metadata `tprt-field`.
The interceptor reports every call's outcome (the status code's name) to a callback, which the
server points at the Prometheus request counter.
"""

from __future__ import annotations

import errno
import logging
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from serve.grpc.wire import Undecodable, lenient
from tprt.errors import TprtError, ValidationError

log = logging.getLogger("tprt.serve")

FIELD_METADATA_KEY = "tprt-field"

Outcome = Callable[[str, str, float], None]  # (method, status code name, seconds)


class ServeError(TprtError):
    """An error with a gRPC status; `field` names the request field at fault, when one is."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field and not message.startswith(field) else message)
        self.field = field


class InvalidArgument(ServeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServeError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServeError):
    code = grpc.StatusCode.ALREADY_EXISTS


class OutOfRange(ServeError):
    code = grpc.StatusCode.OUT_OF_RANGE


class QueueFull(ServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServeError):
    code = grpc.StatusCode.UNAVAILABLE


class InsufficientStorage(ServeError):
    """A write the disk under --data-dir cannot take (full, or a quota reached); HTTP 507."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` says the disk (or the user's quota) is full: ENOSPC/EDQUOT, or SQLite's SQLITE_FULL."""
    if isinstance(e, InsufficientStorage):
        return True
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, sqlite3.OperationalError):
        return getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e)
    return False


DISK_FULL_MESSAGE = "the server's storage (--data-dir) is full; nothing was written"


class FailedPrecondition(ServeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(ServeError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Cancelled(ServeError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(ServeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


ECHO_CHARS = 64  # of a caller's value quoted back in an error message
MAX_MESSAGE_CHARS = 1024
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~])(?:/[^\s/:'\"]+)+/([^\s/:'\"]+)")
_IP_ADDRESS = re.compile(r"\[?\b(?:\d{1,3}\.){3}\d{1,3}\b\]?(?::\d+)?|\[[0-9a-fA-F:]*:[0-9a-fA-F:]*\](?::\d+)?")


def echo(value: str) -> str:
    """`value` quoted for an error message, cut to ECHO_CHARS characters."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


def refuse_undecodable(request: Any, fn: Any) -> None:
    """InvalidArgument for request bytes that did not parse, unless `fn` refuses every request
    anyway (serve/auth.py's denial: the missing token is the first thing to say)."""
    if isinstance(request, Undecodable) and not getattr(fn, "refuses_every_request", False):
        what = "not valid UTF-8 text" if request.field else "not a valid serialized message"
        raise InvalidArgument(f"the {request.message} could not be decoded: {what}", request.field or "request")


class Redactor:
    """Makes a status message safe to show: see the module's docstring."""

    def __init__(self, roots: dict[Path, str] | None = None) -> None:
        # Longest first, so a directory inside another is named by the inner one.
        self._roots = sorted(((str(Path(p).resolve()), label) for p, label in (roots or {}).items()),
                             key=lambda r: -len(r[0]))

    def __call__(self, message: str) -> str:
        for root, label in self._roots:
            message = message.replace(root + "/", label).replace(root, label.rstrip("/") or ".")
        message = _ABSOLUTE_PATH.sub(lambda m: m.group(1), message)
        message = _IP_ADDRESS.sub("<address>", message)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters)"
        return message


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str, str | None]:
    """(code, message, field) for an exception that escaped a handler."""
    if isinstance(e, ServeError):
        return e.code, str(e), e.field
    if isinstance(e, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{e.field}: {e}", e.field
    if is_disk_full(e):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, DISK_FULL_MESSAGE, None
    return grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}); see the server log", None


def _log_and_tag(context: grpc.ServicerContext, method: str, e: Exception,
                 redact: Redactor) -> tuple[grpc.StatusCode, str]:
    code, message, field = status_of(e)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    else:
        log.debug("%s: %s %s", method, code.name, message)
    if field:
        context.set_trailing_metadata(((FIELD_METADATA_KEY, field[:MAX_MESSAGE_CHARS]),))
    return code, redact(message)


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

    def _report(self, method: str, code: grpc.StatusCode, t0: float) -> None:
        if self._on_outcome is not None:
            self._on_outcome(method, code.name.lower(), time.perf_counter() - t0)

    def _unary(self, method: str, fn: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.perf_counter()
            try:
                refuse_undecodable(request, fn)
                response = fn(request, context)
            except Exception as e:  # noqa: BLE001 - every exception becomes a status
                code, message = _log_and_tag(context, method, e, self._redact)
                self._report(method, code, t0)
                context.abort(code, message)  # raises: grpc ends the call with this status
            self._report(method, grpc.StatusCode.OK, t0)
            return response

        return wrapped

    def _stream(self, method: str, fn: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Any]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            t0 = time.perf_counter()
            code = grpc.StatusCode.CANCELLED  # if the generator is closed early (client gone)
            message = ""
            try:
                refuse_undecodable(request, fn)
                yield from fn(request, context)
                code = grpc.StatusCode.OK
            except Exception as e:  # noqa: BLE001 - every exception becomes a status
                code, message = _log_and_tag(context, method, e, self._redact)
            finally:
                self._report(method, code, t0)
            if code != grpc.StatusCode.OK:
                context.abort(code, message)

        return wrapped
