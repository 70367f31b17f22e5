"""A fleet's adapter catalogue: which LoRA adapters the replicas sharing one store serve, so that
an adapter loaded or unloaded through one replica is loaded or unloaded on all of them.

One row per adapter id in the shared database's `adapters` table: the directory it was loaded
from (relative to --data-dir; with --artifacts, published under that name, and fetched by the
other replicas into the same place in their own data dirs), the job that trained it when it came
from one, a version that each load through any replica renews, and whether it was unloaded (a
tombstone: the id answers nowhere until it is loaded again, even where a trained job or a copy
under --data-dir/adapters/ could otherwise bring it back).

Every replica follows the table (`follow`: a short poll, every `POLL_S`): an adapter loaded
elsewhere is registered here on disk (it loads at its first request here, as any other), a newer
version of one registered here replaces it once the old one's requests finish (new requests
naming it here are refused meanwhile, as during an unload: clients retry), and a tombstone
unloads it here. A request that names an id before the poll has seen it is resolved at once
(`find`), as is an adapter a job trained on another replica.

Pinning belongs to the replica that was asked: the others load the adapter unpinned.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve.adapters.pool import AdapterPool
from serve.errors import AlreadyExists, NotFound, ServeError, echo
from serve.store.artifacts import Artifacts
from serve.store.database import Database, next_seq

log = logging.getLogger("tprt.serve")

POLL_S = 2.0
MIGRATIONS = ("""CREATE TABLE IF NOT EXISTS adapters (
    id TEXT PRIMARY KEY, path TEXT NOT NULL, job_id TEXT NOT NULL, version TEXT NOT NULL,
    removed BIGINT NOT NULL, replica TEXT NOT NULL, seq BIGINT NOT NULL
)""",)


class AdapterCatalogue:
    """See the module docstring. `trained` finds the adapter a job trained (any replica's)."""

    def __init__(self, db: Database, data_dir: Path, replica: str, artifacts: Artifacts | None = None,
                 trained: Callable[[str], tuple[Path, str] | None] | None = None) -> None:
        self.db = db
        self.data_dir = Path(data_dir).resolve()
        self.replica = replica
        self.artifacts = artifacts
        self.trained = trained
        db.migrate("adapters", MIGRATIONS)
        self._lock = threading.Lock()
        self._versions: dict[str, str] = {}  # id -> the catalogue version registered on this replica
        self._seen = 0  # the highest seq followed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- what this replica did

    def loaded(self, adapter_id: str, path: Path, job_id: str = "") -> None:
        """LoadAdapter succeeded here: publishes the directory (with --artifacts) and renews the
        row, so the other replicas serve this version."""
        rel = Path(path).resolve().relative_to(self.data_dir).as_posix()
        if self.artifacts is not None and not job_id:  # a job's directory is published already, adapter and all
            self.artifacts.publish(rel)
        version = secrets.token_hex(8)
        with self._lock:
            self._versions[adapter_id] = version
        self._put(adapter_id, rel, job_id, version, removed=False)
        log.info("adapter %s published to the fleet", adapter_id)

    def unloaded(self, adapter_id: str, here: bool) -> bool:
        """UnloadAdapter through this replica (`here`: registered on it): writes the tombstone
        every replica follows, when the adapter is known here or to the fleet (a row, or a job
        that trained it). True when the fleet knew it."""
        row = self.db.one("SELECT removed FROM adapters WHERE id = ?", (adapter_id,))
        if row is not None:
            known = not row["removed"]
        else:
            known = self.trained is not None and self.trained(adapter_id) is not None
        with self._lock:
            self._versions.pop(adapter_id, None)
        if known or here:
            self._put(adapter_id, "", "", secrets.token_hex(8), removed=True)
        return known

    def fetch_job(self, job_id: str) -> None:
        """Brings a job's directory (its adapter) here, when another replica trained it."""
        if self.artifacts is not None and not (self.data_dir / f"jobs/{job_id}").exists():
            self.artifacts.fetch(f"jobs/{job_id}")

    def _put(self, adapter_id: str, rel: str, job_id: str, version: str, removed: bool) -> None:
        self.db.execute("INSERT INTO adapters (id, path, job_id, version, removed, replica, seq) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET path = excluded.path, "
                        "job_id = excluded.job_id, version = excluded.version, removed = excluded.removed, "
                        "replica = excluded.replica, seq = excluded.seq",
                        (adapter_id, rel, job_id, version, int(removed), self.replica, next_seq()))

    # ----------------------------------------------------------------- resolving an id

    def find(self, adapter_id: str) -> tuple[Path, str] | None:
        """The directory (here, fetched first) and source job of an adapter the fleet serves
        under `adapter_id`; None when the fleet has none. NotFound when it was unloaded."""
        row = self.db.one("SELECT * FROM adapters WHERE id = ?", (adapter_id,))
        if row is None:
            return self.trained(adapter_id) if self.trained is not None else None
        if row["removed"]:
            raise NotFound(f"adapter {echo(adapter_id)} was unloaded from the fleet (UnloadAdapter through replica "
                           f"{row['replica']}); LoadAdapter loads it again", "adapter_id")
        path = self._fetch(row)
        with self._lock:
            self._versions[adapter_id] = row["version"]
        return path, row["job_id"]

    def _fetch(self, row: dict[str, Any]) -> Path:
        rel, job_id = row["path"], row["job_id"]
        path = self.data_dir / rel
        if self.artifacts is not None and (row["replica"] != self.replica or not path.exists()):
            self.artifacts.fetch(f"jobs/{job_id}" if job_id else rel)  # an unchanged version is not fetched again
        if not path.exists():
            raise NotFound(f"adapter {echo(row['id'])} was loaded through replica {row['replica']} from {rel}, which "
                           "this replica cannot read; give every replica the same --artifacts, or one shared "
                           "--data-dir", "adapter_id")
        return path

    # ----------------------------------------------------------------- following the others

    def follow(self, pool: AdapterPool, wake: Callable[[], None]) -> None:
        """Starts the poll that applies the other replicas' loads and unloads to `pool`."""
        def run() -> None:
            while not self._stop.is_set():
                try:
                    if self.sync(pool):
                        wake()  # unloads finish on the engine loop's thread
                except (ServeError, OSError) as e:  # the store or the artifacts unreachable: next poll
                    log.warning("adapter catalogue: %s", e)
                self._stop.wait(POLL_S)

        self._thread = threading.Thread(target=run, daemon=True, name="tprt-adapter-catalogue")
        self._thread.start()

    def sync(self, pool: AdapterPool) -> bool:
        """One poll: every row changed since the last, applied here. True when an adapter here
        began to unload."""
        rows = self.db.query("SELECT * FROM adapters WHERE seq > ? ORDER BY seq", (self._seen,))
        unloading = False
        for row in rows:
            adapter_id = row["id"]
            with self._lock:
                current = self._versions.get(adapter_id)
            if current == row["version"]:
                continue  # this replica's own change, or a version it has registered already
            if pool.registry.has(adapter_id):
                pool.begin_unload(adapter_id)  # the old version's requests finish first
                unloading = True
                with self._lock:
                    self._versions.pop(adapter_id, None)
                continue  # a new version registers at the next poll, or at its first request
            if not row["removed"]:
                self._register(pool, row)
        if rows:
            with self._lock:
                pending = [r for r in rows if not r["removed"] and self._versions.get(r["id"]) != r["version"]]
            # Rows whose old version is still draining here are seen again at the next poll.
            self._seen = min([r["seq"] - 1 for r in pending] + [rows[-1]["seq"]])
        return unloading

    def _register(self, pool: AdapterPool, row: dict[str, Any]) -> None:
        try:
            path = self._fetch(row)
            pool.register(row["id"], path, row["job_id"], values=False)  # checked by the ranks at load
        except AlreadyExists:  # a request resolved it meanwhile (`find`)
            pass
        except ServeError as e:  # another id taken here meanwhile, files that do not fit this server
            log.error("adapter %s from replica %s not registered here: %s", row["id"], row["replica"], e)
            with self._lock:
                self._versions[row["id"]] = row["version"]  # not retried every poll
            return
        with self._lock:
            self._versions[row["id"]] = row["version"]
        log.info("adapter %s registered from replica %s", row["id"], row["replica"])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
