"""The fine-tuning job store: the `jobs` table of the server's database (serve/store): an SQLite
file under --data-dir (jobs.sqlite3) for one server, or PostgreSQL shared by a fleet's replicas.

Every state change is committed before the server acts on it, so after a crash or restart the
store says what each job was doing. A replica trains a job only while it holds the job's lease:
`claim` takes the oldest queued job (a row lock that other replicas skip), `renew` extends the
lease while it trains, and every write of the job's progress names the owner, so a replica that
lost its lease (stalled past it, and another replica took the job over) cannot write over the
new owner's. `expire_leases` hands the jobs of a replica that stopped renewing to the others:
re-queued to resume from their last checkpoint, or FAILED with the reason when they have none.
One server on its own file runs `recover()` at start-up instead: every RUNNING job was its own.
`wait()` lets a watcher sleep until a job changes (here; other replicas' changes are polled).

The store is bounded (`max_stored`, --max-stored-jobs): a new job beyond it first prunes the
oldest failed and cancelled jobs (they produced nothing that is served), and is refused
(StoreLimit) when every stored job is queued, running or succeeded. A write the disk cannot take
(SQLite's "database or disk is full", ENOSPC, EDQUOT) raises InsufficientStorage.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from serve.store.database import Database, Row, SqliteDatabase, Transaction, insertion_order, next_seq

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
_LIVE = (QUEUED, RUNNING, SUCCEEDED)  # the states whose job holds its adapter id
_PRUNABLE = (FAILED, CANCELLED)  # the jobs a full store drops, oldest first
DB_NAME = "jobs.sqlite3"
DEFAULT_LEASE_MS = 30_000


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


class LeaseLost(Exception):
    """A write for a job whose lease this replica no longer holds (another replica took the job
    over, or it ended meanwhile)."""


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
_TABLE = f"""
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, method TEXT NOT NULL, dataset TEXT NOT NULL, adapter_id TEXT NOT NULL,
    hyperparameters TEXT NOT NULL, state TEXT NOT NULL CHECK (state IN {STATES!r}),
    created_ms BIGINT NOT NULL, started_ms BIGINT NOT NULL, finished_ms BIGINT NOT NULL,
    step BIGINT NOT NULL, total_steps BIGINT NOT NULL, loss DOUBLE PRECISION NOT NULL,
    tokens_per_second DOUBLE PRECISION NOT NULL, error TEXT NOT NULL, output_path TEXT NOT NULL,
    checkpoint TEXT NOT NULL, cancel_requested BIGINT NOT NULL,
    validation_dataset TEXT NOT NULL DEFAULT '', eval_loss DOUBLE PRECISION,
    trained_tokens BIGINT NOT NULL DEFAULT 0,
    objective TEXT NOT NULL DEFAULT 'supervised', init_adapter TEXT NOT NULL DEFAULT ''
)"""
# Columns that SQLite files of earlier releases (their PRAGMA user_version 1 to 3) lack.
_ADDED_COLUMNS = {"validation_dataset": "TEXT NOT NULL DEFAULT ''", "eval_loss": "DOUBLE PRECISION",
                  "trained_tokens": "BIGINT NOT NULL DEFAULT 0",
                  "objective": "TEXT NOT NULL DEFAULT 'supervised'", "init_adapter": "TEXT NOT NULL DEFAULT ''"}


def _the_jobs_table(tx: Transaction) -> None:
    """Schema 1: the table as release 4 of the SQLite file had it (made, or completed)."""
    tx.execute(_TABLE)
    if tx.dialect == "sqlite":
        have = {row["name"] for row in tx.query("PRAGMA table_info(jobs)")}
        for column, decl in _ADDED_COLUMNS.items():
            if column not in have:
                tx.execute(f"ALTER TABLE jobs ADD COLUMN {column} {decl}")


def _seq_and_leases(tx: Transaction) -> None:
    """Schema 2: the insertion order in a column of its own (SQLite's rowid until then), and the
    lease of the replica that trains the job."""
    insertion_order("jobs")(tx)
    for decl in ("lease_owner TEXT NOT NULL DEFAULT ''", "lease_expires_ms BIGINT NOT NULL DEFAULT 0"):
        tx.execute(f"ALTER TABLE jobs ADD COLUMN {decl}")
    tx.execute("CREATE INDEX IF NOT EXISTS jobs_in_order ON jobs (state, created_ms, seq)")


MIGRATIONS = (_the_jobs_table, _seq_and_leases)


def _to_row(rec: JobRecord) -> tuple[Any, ...]:
    d = asdict(rec)
    d["hyperparameters"] = json.dumps(rec.hyperparameters, sort_keys=True)
    d["cancel_requested"] = int(rec.cancel_requested)
    return tuple(d[c] for c in _COLUMNS)


def _stored(column: str, value: Any) -> Any:
    if column == "hyperparameters":
        return json.dumps(value, sort_keys=True)
    return int(value) if column == "cancel_requested" else value


def _from_row(row: Row) -> JobRecord:
    d = {c: row[c] for c in _COLUMNS}
    d["hyperparameters"] = json.loads(d["hyperparameters"])
    d["cancel_requested"] = bool(d["cancel_requested"])
    return JobRecord(**d)


class JobStore:
    """Jobs in a database (`db`, or the SQLite file `data_dir/jobs.sqlite3`); every method
    commits before it returns; thread-safe."""

    def __init__(self, where: str | Path | Database) -> None:
        self.db = where if isinstance(where, Database) else SqliteDatabase(Path(where) / DB_NAME)
        self.db.migrate("jobs", MIGRATIONS)
        self._changed = threading.Condition()
        self._version = 0

    def close(self) -> None:
        self.db.close()

    def create(self, rec: JobRecord, max_queued: int | None = None,
               max_stored: int | None = None) -> tuple[JobRecord, list[str]]:
        """Stores a new job; returns it and the ids of the jobs pruned to make room (their
        directories are the caller's to remove). In one transaction, the table's only writer
        (atomic between replicas on one database): the oldest failed and cancelled jobs beyond
        `max_stored - 1` are deleted, and the job is inserted if its adapter id is free, fewer
        than `max_queued` jobs wait and fewer than `max_stored` are stored; else nothing changes
        and AdapterIdTaken, QueueLimit or StoreLimit says why."""
        with self.db.transaction() as tx:
            tx.lock("jobs")
            if rec.adapter_id and tx.one("SELECT 1 AS taken FROM jobs WHERE adapter_id = ? AND state IN (?, ?, ?)",
                                         (rec.adapter_id, *_LIVE)):
                raise AdapterIdTaken(rec.adapter_id)
            if max_queued is not None and tx.scalar("SELECT COUNT(*) AS n FROM jobs WHERE state = ?",
                                                    (QUEUED,)) >= max_queued:
                raise QueueLimit(max_queued)
            pruned: list[str] = []
            if max_stored is not None:
                stored = tx.scalar("SELECT COUNT(*) AS n FROM jobs")
                if stored >= max_stored:
                    pruned = [r["id"] for r in tx.query(
                        "SELECT id FROM jobs WHERE state IN (?, ?) ORDER BY created_ms, seq LIMIT ?",
                        (*_PRUNABLE, stored - max_stored + 1))]
                    if stored - len(pruned) >= max_stored:
                        raise StoreLimit(max_stored)
                    tx.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in pruned])
            tx.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}, seq) VALUES ({', '.join('?' * (len(_COLUMNS) + 1))})",
                       (*_to_row(rec), next_seq()))
        self._bump()
        return rec, pruned

    def get(self, job_id: str) -> JobRecord | None:
        row = self.db.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return _from_row(row) if row is not None else None

    def select(self, state: str | None = None, limit: int = 100) -> list[JobRecord]:
        """Newest first (jobs of the same millisecond in the order inserted: the ids are random)."""
        where, args = ("WHERE state = ?", [state]) if state else ("", [])
        rows = self.db.query(f"SELECT * FROM jobs {where} ORDER BY created_ms DESC, seq DESC LIMIT ?", (*args, limit))
        return [_from_row(r) for r in rows]

    def page(self, after: str | None, limit: int) -> list[JobRecord]:
        """Newest first, the `limit` jobs created before job `after` (from the newest when None);
        KeyError when `after` is not a job."""
        if after is None:
            rows = self.db.query("SELECT * FROM jobs ORDER BY created_ms DESC, seq DESC LIMIT ?", (limit,))
        else:
            with self.db.transaction() as tx:
                mark = tx.one("SELECT created_ms, seq FROM jobs WHERE id = ?", (after,))
                if mark is None:
                    raise KeyError(after)
                rows = tx.query("SELECT * FROM jobs WHERE created_ms < ? OR (created_ms = ? AND seq < ?) "
                                "ORDER BY created_ms DESC, seq DESC LIMIT ?",
                                (mark["created_ms"], mark["created_ms"], mark["seq"], limit))
        return [_from_row(r) for r in rows]

    def using_dataset(self, dataset: str) -> list[JobRecord]:
        """The queued and running jobs that will read `dataset` (a path relative to --data-dir), to
        train on or to evaluate with."""
        rows = self.db.query("SELECT * FROM jobs WHERE ? IN (dataset, validation_dataset) AND state IN (?, ?)",
                             (dataset, QUEUED, RUNNING))
        return [_from_row(r) for r in rows]

    def update(self, job_id: str, owner: str | None = None, **changes: Any) -> JobRecord:
        """Sets the given fields (only those: another replica's write of other fields stays);
        returns the job as stored afterwards. KeyError if unknown; with `owner`, LeaseLost unless
        that replica holds the job's lease."""
        bad = (set(changes) - set(_COLUMNS)) | ({"id"} & set(changes))
        if bad:
            raise ValueError(f"JobStore.update: unknown or read-only fields {sorted(bad)}")
        with self.db.transaction() as tx:
            if changes:
                sets = ", ".join(f"{c} = ?" for c in changes)
                guard, args = (" AND lease_owner = ? AND state = ?", (owner, RUNNING)) if owner is not None else ("", ())
                done = tx.execute(f"UPDATE jobs SET {sets} WHERE id = ?{guard}",
                                  (*(_stored(c, v) for c, v in changes.items()), job_id, *args))
            row = tx.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if row is None:
            raise KeyError(job_id)
        if changes and not done:
            raise LeaseLost(f"{job_id} is no longer this replica's to train (now {row['state']}, "
                            f"held by {row['lease_owner'] or 'no replica'})")
        self._bump()
        return _from_row(row)

    def next_queued(self) -> JobRecord | None:
        """The oldest queued job: first created, and of jobs created in one millisecond the first
        inserted (the ids are random)."""
        row = self.db.one("SELECT * FROM jobs WHERE state = ? ORDER BY created_ms, seq LIMIT 1", (QUEUED,))
        return _from_row(row) if row is not None else None

    def claim(self, owner: str, lease_ms: int = DEFAULT_LEASE_MS) -> JobRecord | None:
        """Takes the oldest queued job for replica `owner`: RUNNING, its lease `lease_ms` from now.
        Replicas claiming at once take different jobs (the row lock makes the others skip it)."""
        with self.db.transaction() as tx:
            row = tx.one(f"SELECT * FROM jobs WHERE state = ? ORDER BY created_ms, seq LIMIT 1{tx.skip_locked}",
                         (QUEUED,))
            if row is None:
                return None
            now = now_ms()
            tx.execute("UPDATE jobs SET state = ?, started_ms = ?, lease_owner = ?, lease_expires_ms = ? WHERE id = ?",
                       (RUNNING, row["started_ms"] or now, owner, now + lease_ms, row["id"]))
            row = tx.one("SELECT * FROM jobs WHERE id = ?", (row["id"],))
        self._bump()
        return _from_row(row) if row is not None else None

    def renew(self, job_id: str, owner: str, lease_ms: int = DEFAULT_LEASE_MS) -> bool:
        """Extends `owner`'s lease on a running job; False when it holds it no more."""
        return self.db.execute("UPDATE jobs SET lease_expires_ms = ? WHERE id = ? AND lease_owner = ? AND state = ?",
                               (now_ms() + lease_ms, job_id, owner, RUNNING)) == 1

    def lease_owner(self, job_id: str) -> str:
        row = self.db.one("SELECT lease_owner FROM jobs WHERE id = ?", (job_id,))
        return str(row["lease_owner"]) if row else ""

    def expire_leases(self, resumable: Callable[[JobRecord], bool]) -> list[JobRecord]:
        """The running jobs whose replica stopped renewing their lease: re-queued to resume from
        their checkpoint when `resumable`, else FAILED. Returns the jobs it changed."""
        with self.db.transaction() as tx:
            rows = tx.query(f"SELECT * FROM jobs WHERE state = ? AND lease_expires_ms < ?{tx.skip_locked}",
                            (RUNNING, now_ms()))
            changed = [self._interrupt(tx, _from_row(r), resumable,
                                       f"resumed from step {r['step']}: replica {r['lease_owner'] or '?'} stopped "
                                       "renewing its lease", f"replica {r['lease_owner'] or '?'} stopped while the "
                                       "job was running") for r in rows]
        if changed:
            self._bump()
        return changed

    def counts(self) -> dict[str, int]:
        rows = self.db.query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")
        return {r["state"]: int(r["n"]) for r in rows}

    def adapter_taken(self, adapter_id: str) -> bool:
        """Whether a job that has not failed or been cancelled already produces `adapter_id`."""
        return self.db.one("SELECT 1 AS taken FROM jobs WHERE adapter_id = ? AND state IN (?, ?, ?) LIMIT 1",
                           (adapter_id, *_LIVE)) is not None

    def trained(self, adapter_id: str) -> JobRecord | None:
        """The succeeded LoRA job that produced `adapter_id`, if one did."""
        row = self.db.one("SELECT * FROM jobs WHERE adapter_id = ? AND state = ? AND method = 'lora' "
                          "AND output_path != '' ORDER BY finished_ms DESC LIMIT 1", (adapter_id, SUCCEEDED))
        return _from_row(row) if row is not None else None

    def recover(self, data_dir: Path) -> list[JobRecord]:
        """After a restart of the one server on this database: every RUNNING job was its own, and
        is re-queued when its checkpoint exists (it resumes from it), otherwise marked FAILED with
        the reason. Returns the jobs it changed."""
        with self.db.transaction() as tx:
            changed = [self._interrupt(tx, _from_row(r), lambda rec: has_checkpoint(rec, data_dir),
                                       f"resumed from step {r['step']} after a server restart",
                                       "the server stopped while the job was running")
                       for r in tx.query("SELECT * FROM jobs WHERE state = ?", (RUNNING,))]
        self._bump()
        return changed

    def interrupt(self, rec: JobRecord, data_dir: Path, queued: str, failed: str) -> JobRecord:
        """A job whose run stopped without ending it: QUEUED to resume from its checkpoint when it
        has one (its error saying `queued`), otherwise FAILED (saying `failed` and why)."""
        with self.db.transaction() as tx:
            changed = self._interrupt(tx, rec, lambda r: has_checkpoint(r, data_dir), queued, failed)
        self._bump()
        return changed

    @staticmethod
    def _interrupt(tx: Transaction, rec: JobRecord, resumable: Callable[[JobRecord], bool], queued: str,
                   failed: str) -> JobRecord:
        if resumable(rec):
            rec.state, rec.error = QUEUED, queued
        else:
            rec.state, rec.finished_ms = FAILED, now_ms()
            rec.error = f"{failed} and it had no checkpoint to resume from"
        tx.execute("UPDATE jobs SET state = ?, error = ?, finished_ms = ?, lease_owner = '', lease_expires_ms = 0 "
                   "WHERE id = ?", (rec.state, rec.error, rec.finished_ms, rec.id))
        return rec

    def _bump(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def wait(self, version: int, timeout: float) -> int:
        """Blocks until some job changes after `version` (or `timeout` s); returns the new version."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != version, timeout)
            return self._version

    @property
    def version(self) -> int:
        with self._changed:
            return self._version

    def __iter__(self) -> Iterator[JobRecord]:
        return iter(self.select(limit=1_000_000))


def has_checkpoint(rec: JobRecord, data_dir: Path) -> bool:
    """Whether the job has a training checkpoint to resume from under `data_dir`."""
    return bool(rec.checkpoint) and (data_dir / rec.checkpoint).exists()
