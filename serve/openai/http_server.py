"""uvicorn on a thread of rank 0, serving the OpenAI API (serve/openai/app.py) beside gRPC.

The socket is bound when `tprt serve` starts (a busy --http-port fails before any rank starts);
uvicorn serves on it from `start()` (once the engine loop runs) until `stop()`. Its connections
are bounded and timed by serve/openai/http_guard.py, which also does TLS (--tls-cert / --tls-key, as
gRPC has them), so that a handshake counts as a connection under the header deadline.
"""

from __future__ import annotations

import functools
import logging
import resource
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from serve.openai.http_guard import ConnectionGuard, GuardedH11Protocol, Headers, HttpLimits, install_log_limits
from tprt.errors import ConfigError

log = logging.getLogger("tprt.serve")

FD_RESERVE = 256  # descriptors kept for gRPC, /metrics, the ranks' sockets, files and the model
# The listen queue, and what asyncio accepts at once before the guard sees any of it: descriptors
# peak at --http-max-connections + about twice this (accepted, and evicted but not yet closed).
BACKLOG = 64


class HttpServer:
    """One uvicorn server on a pre-bound socket, in a daemon thread."""

    def __init__(self, host: str, port: int, tls_cert: Path | None, tls_key: Path | None,
                 limits: HttpLimits | None = None) -> None:
        self.limits = _fit_to_descriptors(limits or HttpLimits())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise ConfigError(f"--host/--http-port {host}:{port}: cannot listen there ({e.strerror})") from None
        # Listening now: connections made as soon as the server announces itself wait in the
        # backlog until uvicorn's thread accepts them, instead of being refused.
        self.sock.listen(BACKLOG)
        self.port = int(self.sock.getsockname()[1])
        self.tls: ssl.SSLContext | None = None
        if tls_cert is not None and tls_key is not None:
            self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.tls.load_cert_chain(str(tls_cert), str(tls_key))
        self.guard: ConnectionGuard | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def start(self, app: FastAPI, trusted: Callable[[Headers], bool] = lambda headers: True) -> None:
        """Serves `app`; `trusted` tells a request's headers that carry the token (serve/auth.py)."""
        self.guard = ConnectionGuard(self.limits, trusted)
        protocol = functools.partial(GuardedH11Protocol, guard=self.guard, tls=self.tls)
        config = uvicorn.Config(app, http=protocol, log_level="warning", access_log=False,  # type: ignore[arg-type]
                                lifespan="off", timeout_graceful_shutdown=5, server_header=False, backlog=BACKLOG)
        install_log_limits()  # after uvicorn's Config, which configures its loggers
        self._server = uvicorn.Server(config)
        server = self._server
        self._thread = threading.Thread(target=lambda: server.run(sockets=[self.sock]), name="tprt-http",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
        self.sock.close()


def _fit_to_descriptors(limits: HttpLimits) -> HttpLimits:
    """Raises this process's descriptor limit to its hard limit if that is needed for
    --http-max-connections (plus FD_RESERVE); where it cannot be, fewer connections, said once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = limits.max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fit = max(1, soft - FD_RESERVE)
        log.warning("--http-max-connections %d: the descriptor limit is %d; serving at most %d HTTP connections",
                    limits.max_connections, soft, fit)
        return HttpLimits(limits.header_timeout, limits.body_timeout, fit, min(limits.max_unauthenticated, fit))
    return limits
