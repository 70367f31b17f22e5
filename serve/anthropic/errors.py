"""The serve core's errors (serve/errors.py) in Anthropic's shape: an HTTP status and
`{"type": "error", "error": {"type", "message"}, "request_id"}`, the error types Anthropic's API
documents (its SDK raises by status: 400, 401, 404, 413, 429, 500, 529). The message starts with
the parameter at fault, as every error of ours does.
"""

from __future__ import annotations

import secrets
from typing import Any

from serve.errors import Status, is_disk_full, status_of

ANTHROPIC_PATHS = ("/v1/messages",)  # the routes whose errors take this shape

_STATUS = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.OUT_OF_RANGE: (400, "invalid_request_error"),
    Status.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Status.UNAUTHENTICATED: (401, "authentication_error"),
    Status.NOT_FOUND: (404, "not_found_error"),
    Status.ALREADY_EXISTS: (409, "invalid_request_error"),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Status.CANCELLED: (499, "invalid_request_error"),
    Status.UNAVAILABLE: (529, "overloaded_error"),  # Anthropic's "overloaded": its SDK retries it
    Status.DEADLINE_EXCEEDED: (504, "timeout_error"),
    Status.INTERNAL: (500, "api_error"),
}


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def anthropic_error_body(e: BaseException, too_large: bool = False) -> tuple[int, dict[str, Any], str]:
    """(HTTP status, Anthropic's error JSON, outcome name for the metrics) of an exception;
    `too_large`: a body over the size limit (413 request_too_large)."""
    status, message, _ = status_of(e)
    http, kind = _STATUS.get(status, (500, "api_error"))
    if too_large:
        http, kind = 413, "request_too_large"
    elif is_disk_full(e):
        http, kind = 507, "api_error"
    return http, {"type": "error", "error": {"type": kind, "message": message},
                  "request_id": "req_" + secrets.token_hex(12)}, status.outcome
