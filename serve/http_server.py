"""uvicorn on a thread of rank 0, serving the OpenAI API (serve/openai_app.py) beside gRPC.

The socket is bound when `tprt serve` starts (a busy --http-port fails before any rank starts);
uvicorn serves on it from `start()` (once the scheduler runs) until `stop()`, with --tls-cert /
--tls-key when gRPC has them.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from tprt.errors import ConfigError


class HttpServer:
    """One uvicorn server on a pre-bound socket, in a daemon thread."""

    def __init__(self, host: str, port: int, tls_cert: Path | None, tls_key: Path | None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise ConfigError(f"--host/--http-port {host}:{port}: cannot listen there ({e.strerror})") from None
        self.port = int(self.sock.getsockname()[1])
        self.tls = (tls_cert, tls_key)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls[0] is not None else "http"

    def start(self, app: FastAPI) -> None:
        cert, key = self.tls
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                ssl_certfile=str(cert) if cert else None, ssl_keyfile=str(key) if key else None,
                                timeout_graceful_shutdown=5)
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
