"""Bearer-token authentication: every method but the health check needs `authorization: Bearer <token>`.

HTTP (serve/openai/app.py, serve/openai/http_guard.py) checks the same token on a request's headers
with `TokenCheck`, before any of its body is read.

The token is read once from --auth-token-file (surrounding whitespace stripped) and compared in
constant time. gRPC's interceptor is serve/grpc/auth.py.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tprt.errors import ConfigError

MAX_TOKEN_BYTES = 4096


def load_token(path: str | Path) -> str:
    """The token in `path`; a one-line ConfigError when it is unreadable, empty or not one line."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"--auth-token-file {p}: cannot read it ({e.strerror})") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise ConfigError(f"--auth-token-file {p}: {len(raw)} bytes; a token is at most {MAX_TOKEN_BYTES}")
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"--auth-token-file {p}: the token must be printable ASCII") from None
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"--auth-token-file {p}: expected one token (printable, no spaces) on one line")
    return token


def bearer(metadata: Any) -> str | None:
    """The token of an `authorization: Bearer <token>` header among `metadata`, if any."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class TokenCheck:
    """Whether raw HTTP headers carry `Authorization: Bearer <token>`, or `x-api-key: <token>` as
    Anthropic's clients send it (constant time); with no token configured, every request passes."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token is not None else None

    @property
    def required(self) -> bool:
        return self._token is not None

    def __call__(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        if self._token is None:
            return True
        ok = False
        for key, value in headers:
            key = key.lower()
            if key == b"authorization":
                scheme, _, got = value.partition(b" ")
                if scheme.lower() == b"bearer" and got.strip():
                    ok |= hmac.compare_digest(got.strip(), self._token)
            elif key == b"x-api-key" and value.strip():
                ok |= hmac.compare_digest(value.strip(), self._token)
        return ok
