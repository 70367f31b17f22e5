"""The fine-tuning job store: one SQLite database under --data-dir (jobs.sqlite3).

Every state change is committed before the server acts on it, so after a crash or restart the
store says what each job was doing. `recover()` runs at start-up: a job that was RUNNING is
re-queued to resume from its last checkpoint when it has one, or marked FAILED with the reason.
`JobStore` is thread-safe (one connection behind a lock) and `wait()` lets a watcher sleep until
a job changes.

The store is bounded (`max_stored`, --max-stored-jobs): a new job beyond it first prunes the
oldest failed and cancelled jobs (they produced nothing that is served), and is refused
(StoreLimit) when every stored job is queued, running or succeeded. A write the disk cannot take
(SQLite's "database or disk is full", ENOSPC, EDQUOT) raises InsufficientStorage.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from serve.errors import DISK_FULL_MESSAGE, InsufficientStorage, is_disk_full

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
_LIVE = (QUEUED, RUNNING, SUCCEEDED)  # the states whose job holds its adapter id
_PRUNABLE = (FAILED, CANCELLED)  # the jobs a full store drops, oldest first
DB_NAME = "jobs.sqlite3"
SCHEMA_VERSION = 4  # 2: validation_dataset, eval_loss; 3: trained_tokens; 4: objective, init_adapter


def now_ms() -> int:
    return int(time.time() * 1000)


def new_job_id() -> str:
    return "job-" + secrets.token_hex(6)


class AdapterIdTaken(Exception):
    """JobStore.create: a queued, running or succeeded job already produces this adapter id."""


class QueueLimit(Exception):
    """JobStore.create: as many jobs as allowed already wait."""


class StoreLimit(Exception):
    """JobStore.create: as many jobs as allowed are stored, none of them failed or cancelled."""


@dataclass
class JobRecord:
    """One fine-tuning job, as stored."""

    id: str
    method: str  # "lora" or "full"
    dataset: str  # path of the JSONL file, relative to --data-dir
    adapter_id: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)  # every default filled in
    state: str = QUEUED
    created_ms: int = field(default_factory=now_ms)
    started_ms: int = 0
    finished_ms: int = 0
    step: int = 0
    total_steps: int = 0
    loss: float = 0.0
    tokens_per_second: float = 0.0
    error: str = ""
    output_path: str = ""  # the adapter or checkpoint written, relative to --data-dir
    checkpoint: str = ""  # the latest resumable training checkpoint, relative to --data-dir
    cancel_requested: bool = False
    validation_dataset: str = ""  # a held-out JSONL, relative to --data-dir ("" = none)
    eval_loss: float | None = None  # its loss after the last step
    trained_tokens: int = 0  # tokens of every step's examples, padding left out
    objective: str = "supervised"  # or "dpo" (preference pairs; beta etc. in hyperparameters)
    init_adapter: str = ""  # LoRA: the adapter the job starts from, relative to --data-dir ("" = none)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


_COLUMNS = [f.name for f in fields(JobRecord)]
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, method TEXT NOT NULL, dataset TEXT NOT NULL, adapter_id TEXT NOT NULL,
    hyperparameters TEXT NOT NULL, state TEXT NOT NULL CHECK (state IN {STATES!r}),
    created_ms INTEGER NOT NULL, started_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL,
    step INTEGER NOT NULL, total_steps INTEGER NOT NULL, loss REAL NOT NULL,
    tokens_per_second REAL NOT NULL, error TEXT NOT NULL, output_path TEXT NOT NULL,
    checkpoint TEXT NOT NULL, cancel_requested INTEGER NOT NULL,
    validation_dataset TEXT NOT NULL DEFAULT '', eval_loss REAL, trained_tokens INTEGER NOT NULL DEFAULT 0,
    objective TEXT NOT NULL DEFAULT 'supervised', init_adapter TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, created_ms);
"""
_ADDED_COLUMNS = {"validation_dataset": "TEXT NOT NULL DEFAULT ''", "eval_loss": "REAL",  # since schema 1
                  "trained_tokens": "INTEGER NOT NULL DEFAULT 0",  # since schema 2
                  "objective": "TEXT NOT NULL DEFAULT 'supervised'", "init_adapter": "TEXT NOT NULL DEFAULT ''"}


def _to_row(rec: JobRecord) -> tuple[Any, ...]:
    d = asdict(rec)
    d["hyperparameters"] = json.dumps(rec.hyperparameters, sort_keys=True)
    d["cancel_requested"] = int(rec.cancel_requested)
    return tuple(d[c] for c in _COLUMNS)


def _from_row(row: sqlite3.Row) -> JobRecord:
    d = {c: row[c] for c in _COLUMNS}
    d["hyperparameters"] = json.loads(d["hyperparameters"])
    d["cancel_requested"] = bool(d["cancel_requested"])
    return JobRecord(**d)


class JobStore:
    """Jobs in `data_dir/jobs.sqlite3`; every method commits before it returns."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._version = 0
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            self._add_new_columns()
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _add_new_columns(self) -> None:
        """A database from an older server gains the columns added since (schema 1 -> 2)."""
        have = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, decl in _ADDED_COLUMNS.items():
            if column not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {decl}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(self, rec: JobRecord, max_queued: int | None = None,
               max_stored: int | None = None) -> tuple[JobRecord, list[str]]:
        """Stores a new job; returns it and the ids of the jobs pruned to make room (their
        directories are the caller's to remove). In one transaction (atomic even between processes
        on one database): the oldest failed and cancelled jobs beyond `max_stored - 1` are deleted,
        and the job is inserted if its adapter id is free, fewer than `max_queued` jobs wait and
        fewer than `max_stored` are stored; else nothing changes and AdapterIdTaken, QueueLimit
        or StoreLimit says why."""
        marks = ", ".join("?" for _ in _COLUMNS)
        with self._lock, self._writing():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                pruned: list[str] = []
                if max_stored is not None:
                    (stored,) = self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()
                    if stored >= max_stored:
                        pruned = [r[0] for r in self._db.execute(
                            "SELECT id FROM jobs WHERE state IN (?, ?) ORDER BY created_ms, rowid LIMIT ?",
                            (*_PRUNABLE, stored - max_stored + 1))]
                        self._db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in pruned])
                inserted = self._db.execute(
                    f"INSERT INTO jobs ({', '.join(_COLUMNS)}) SELECT {marks} "
                    f"WHERE (? = '' OR NOT EXISTS (SELECT 1 FROM jobs WHERE adapter_id = ? AND state IN (?, ?, ?))) "
                    f"AND (? IS NULL OR (SELECT COUNT(*) FROM jobs WHERE state = ?) < ?) "
                    f"AND (? IS NULL OR (SELECT COUNT(*) FROM jobs) < ?)",
                    (*_to_row(rec), rec.adapter_id, rec.adapter_id, *_LIVE, max_queued, QUEUED, max_queued,
                     max_stored, max_stored)).rowcount
                if not inserted:
                    taken = self._db.execute("SELECT 1 FROM jobs WHERE adapter_id = ? AND state IN (?, ?, ?)",
                                             (rec.adapter_id, *_LIVE)).fetchone()
                    (waiting,) = self._db.execute("SELECT COUNT(*) FROM jobs WHERE state = ?", (QUEUED,)).fetchone()
                    if rec.adapter_id and taken:
                        raise AdapterIdTaken(rec.adapter_id)
                    raise QueueLimit(max_queued) if max_queued is not None and waiting >= max_queued \
                        else StoreLimit(max_stored)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            self._bump()
        return rec, pruned

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _from_row(row) if row is not None else None

    def select(self, state: str | None = None, limit: int = 100) -> list[JobRecord]:
        """Newest first (jobs of the same millisecond in the order inserted: the ids are random)."""
        where, args = ("WHERE state = ?", [state]) if state else ("", [])
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM jobs {where} ORDER BY created_ms DESC, rowid DESC LIMIT ?", (*args, limit)
            ).fetchall()
        return [_from_row(r) for r in rows]

    def page(self, after: str | None, limit: int) -> list[JobRecord]:
        """Newest first, the `limit` jobs created before job `after` (from the newest when None);
        KeyError when `after` is not a job."""
        with self._lock:
            if after is None:
                rows = self._db.execute("SELECT * FROM jobs ORDER BY created_ms DESC, rowid DESC LIMIT ?",
                                        (limit,)).fetchall()
            else:
                mark = self._db.execute("SELECT created_ms, rowid FROM jobs WHERE id = ?", (after,)).fetchone()
                if mark is None:
                    raise KeyError(after)
                rows = self._db.execute(
                    "SELECT * FROM jobs WHERE (created_ms, rowid) < (?, ?) ORDER BY created_ms DESC, rowid DESC "
                    "LIMIT ?", (mark[0], mark[1], limit)).fetchall()
        return [_from_row(r) for r in rows]

    def using_dataset(self, dataset: str) -> list[JobRecord]:
        """The queued and running jobs that will read `dataset` (a path relative to --data-dir), to
        train on or to evaluate with."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE ? IN (dataset, validation_dataset) "
                                    "AND state IN (?, ?)", (dataset, QUEUED, RUNNING)).fetchall()
        return [_from_row(r) for r in rows]

    def update(self, job_id: str, **changes: Any) -> JobRecord:
        """Sets the given fields; returns the job as stored afterwards. KeyError if unknown."""
        bad = (set(changes) - set(_COLUMNS)) | ({"id"} & set(changes))
        if bad:
            raise ValueError(f"JobStore.update: unknown or read-only fields {sorted(bad)}")
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise KeyError(job_id)
            rec = _from_row(row)
            for k, v in changes.items():
                setattr(rec, k, v)
            sets = ", ".join(f"{c} = ?" for c in _COLUMNS[1:])
            with self._writing():
                self._db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*_to_row(rec)[1:], job_id))
            self._bump()
        return rec

    def next_queued(self) -> JobRecord | None:
        """The oldest queued job: first created, and of jobs created in one millisecond the first
        inserted (rowid; the ids are random)."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM jobs WHERE state = ? ORDER BY created_ms, rowid LIMIT 1", (QUEUED,)
            ).fetchone()
        return _from_row(row) if row is not None else None

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {state: int(n) for state, n in rows}

    def adapter_taken(self, adapter_id: str) -> bool:
        """Whether a job that has not failed or been cancelled already produces `adapter_id`."""
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM jobs WHERE adapter_id = ? AND state IN (?, ?, ?) LIMIT 1", (adapter_id, *_LIVE),
            ).fetchone()
        return row is not None

    def recover(self, data_dir: Path) -> list[JobRecord]:
        """After a restart: RUNNING jobs are re-queued when their checkpoint exists (they resume
        from it), otherwise marked FAILED with the reason. Returns the jobs it changed."""
        return [self.interrupt(rec, data_dir, f"resumed from step {rec.step} after a server restart",
                               "the server stopped while the job was running")
                for rec in self.select(RUNNING, limit=1_000_000)]

    def interrupt(self, rec: JobRecord, data_dir: Path, queued: str, failed: str) -> JobRecord:
        """A job whose run stopped without ending it: QUEUED to resume from its checkpoint when it
        has one (its error saying `queued`), otherwise FAILED (saying `failed` and why)."""
        if rec.checkpoint and (data_dir / rec.checkpoint).exists():
            return self.update(rec.id, state=QUEUED, error=queued)
        return self.update(rec.id, state=FAILED, finished_ms=now_ms(),
                           error=f"{failed} and it had no checkpoint to resume from")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write; the disk being full becomes InsufficientStorage (other errors pass unchanged)."""
        try:
            yield
        except (sqlite3.Error, OSError) as e:
            if is_disk_full(e):
                raise InsufficientStorage(f"{DISK_FULL_MESSAGE} (the job store: {e})") from e
            raise

    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def wait(self, version: int, timeout: float) -> int:
        """Blocks until some job changes after `version` (or `timeout` s); returns the new version."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != version, timeout)
            return self._version

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def __iter__(self) -> Iterator[JobRecord]:
        return iter(self.select(limit=1_000_000))
