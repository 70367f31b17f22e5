"""`tprt serve` as a subprocess on loopback, for scripts (the demo, the benchmark): started on free
ports, ready once it prints its `listening on` line, stopped with SIGTERM (it drains)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tprt.errors import TprtError


class LocalServer:
    """`tprt serve ARGS` with --port 0 (and the caller's other flags); `target` is HOST:PORT,
    `metrics_url` the /metrics address when metrics are on, `banner` the ready line."""

    def __init__(self, args: list[str], log: Path, start_timeout_s: float = 300.0) -> None:
        cmd = [sys.executable, "-u", "-m", "tprt.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        found: list[str] = []
        ready = threading.Event()

        def read() -> None:  # also keeps draining stdout so the server never blocks on it
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if "listening on" in line and not found:
                    found.append(line.strip())
                    ready.set()
            ready.set()  # the server exited

        threading.Thread(target=read, daemon=True).start()
        match = re.search(r"listening on (\S+)", found[0]) if ready.wait(start_timeout_s) and found else None
        if match is None:
            self.stop()
            raise TprtError(f"tprt serve did not start; its log is {log}")
        self.banner, self.target = found[0], match.group(1)
        metrics = re.search(r"metrics (http://\S+/metrics)", self.banner)
        self.metrics_url = metrics.group(1) if metrics else None

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM, then the exit status (killed after `timeout_s`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
