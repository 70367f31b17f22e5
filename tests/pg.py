"""A throwaway PostgreSQL server for the tests: the distribution's binaries (scripts/setup.sh
installs Debian's postgresql where they are missing), a cluster made in a temporary directory,
trust authentication on 127.0.0.1 only, one fresh database per `database()` call. Run as the
`postgres` user when the tests run as root (the server refuses root)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def _bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed: run scripts/setup.sh (it installs Debian's "
                           "postgresql) or apt-get install postgresql")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    def __init__(self) -> None:
        # A directory of its own in /tmp: the postgres user must reach it, and pytest's are root's.
        self.root = root = Path(tempfile.mkdtemp(prefix="tprt-pg-"))
        self.data = root / "pgdata"
        self.port = free_port()
        self.as_user: dict[str, Any] = {}
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            self.as_user = {"user": pw.pw_uid, "group": pw.pw_gid}
            os.chown(root, pw.pw_uid, pw.pw_gid)
        made = subprocess.run([_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                               "--no-sync"], capture_output=True, text=True, **self.as_user)
        if made.returncode:
            raise RuntimeError(f"initdb failed: {made.stderr[-2000:]}")
        self.log = root / "postgres.log"
        self.proc = subprocess.Popen(
            [_bin("postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(root),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"), **self.as_user)
        self._wait_ready()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _wait_ready(self, timeout: float = 60) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.url(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
