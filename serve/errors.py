"""The errors every front end raises, in one vocabulary of our own (`Status`).

Handlers raise; they never set a protocol's status themselves. Each front end maps what escapes:
gRPC to its status codes (serve/grpc/errors.py, whose interceptor wraps every method), each HTTP
API to its HTTP statuses and error bodies (serve/openai/requests.py, serve/anthropic/errors.py).
`status_of` is the one reading of an exception they share:

    ServeError subclasses          -> their own status (INVALID_ARGUMENT, NOT_FOUND, OUT_OF_RANGE, ...)
    tprt.errors.ValidationError    -> INVALID_ARGUMENT naming the field
    a full disk (ENOSPC, EDQUOT,   -> RESOURCE_EXHAUSTED (HTTP 507, InsufficientStorage): a write
      SQLite's SQLITE_FULL)           that does not fit is refused, the server goes on
    anything else                  -> INTERNAL, logged with its traceback (a server bug, never a
                                      client mistake)

The statuses are the canonical error codes of Google's API design (gRPC's, with HTTP mappings
well known), written here without any protocol's library: the core, the jobs and the HTTP APIs
import no gRPC.

Status messages are safe to show (`Redactor`): the server's own directories become names relative
to them (`--data-dir`'s `jobs/job-.../dataset.jsonl`), any other absolute path its last component,
IP addresses `<address>`, and the whole is cut to MAX_MESSAGE_CHARS; callers' values are quoted
through `echo` (cut to ECHO_CHARS). The full message goes to the server log (debug level).

An INVALID_ARGUMENT / OUT_OF_RANGE message starts with the field's path (e.g.
"sampling.top_p: ..."), which each front end spells its own way.
"""

from __future__ import annotations

import enum
import errno
import re
import sqlite3
from pathlib import Path

from tprt.errors import TprtError, ValidationError


class Status(enum.Enum):
    """Why a request failed, whatever protocol carried it (the canonical codes; `name.lower()`
    labels the outcome in the metrics)."""

    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    OUT_OF_RANGE = 11
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16

    @property
    def outcome(self) -> str:
        return self.name.lower()


class ServeError(TprtError):
    """An error with a status; `field` names the request field at fault, when one is."""

    status = Status.INTERNAL

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field and not message.startswith(field) else message)
        self.field = field


class InvalidArgument(ServeError):
    status = Status.INVALID_ARGUMENT


class NotFound(ServeError):
    status = Status.NOT_FOUND


class AlreadyExists(ServeError):
    status = Status.ALREADY_EXISTS


class OutOfRange(ServeError):
    status = Status.OUT_OF_RANGE


class QueueFull(ServeError):
    status = Status.RESOURCE_EXHAUSTED


class Unavailable(ServeError):
    status = Status.UNAVAILABLE


class InsufficientStorage(ServeError):
    """A write the disk under --data-dir cannot take (full, or a quota reached); HTTP 507."""

    status = Status.RESOURCE_EXHAUSTED


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
    status = Status.FAILED_PRECONDITION


class Unauthenticated(ServeError):
    status = Status.UNAUTHENTICATED


class Cancelled(ServeError):
    status = Status.CANCELLED


class DeadlineExceeded(ServeError):
    status = Status.DEADLINE_EXCEEDED


ECHO_CHARS = 64  # of a caller's value quoted back in an error message
MAX_MESSAGE_CHARS = 1024
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~])(?:/[^\s/:'\"]+)+/([^\s/:'\"]+)")
_IP_ADDRESS = re.compile(r"\[?\b(?:\d{1,3}\.){3}\d{1,3}\b\]?(?::\d+)?|\[[0-9a-fA-F:]*:[0-9a-fA-F:]*\](?::\d+)?")


def echo(value: str) -> str:
    """`value` quoted for an error message, cut to ECHO_CHARS characters."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


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


def status_of(e: BaseException) -> tuple[Status, str, str | None]:
    """(status, message, field) for an exception that escaped a handler."""
    if isinstance(e, ServeError):
        return e.status, str(e), e.field
    if isinstance(e, ValidationError):
        return Status.INVALID_ARGUMENT, f"{e.field}: {e}", e.field
    if is_disk_full(e):
        return Status.RESOURCE_EXHAUSTED, DISK_FULL_MESSAGE, None
    return Status.INTERNAL, f"internal error ({type(e).__name__}); see the server log", None
