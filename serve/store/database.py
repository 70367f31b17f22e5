"""The server's relational state in one of two databases: SQLite (files under --data-dir, the
default for one server) or PostgreSQL (`tprt serve --store postgresql://...`, shared by the
replicas of a fleet), through psycopg and its connection pool.

The stores (jobs, stored responses, batches) write their SQL once, for both:

- `?` placeholders (turned into psycopg's `%s` for PostgreSQL);
- types both know: TEXT, BIGINT, DOUBLE PRECISION (SQLite reads them by affinity);
- `INSERT ... ON CONFLICT (key) DO UPDATE` rather than SQLite's `INSERT OR REPLACE`;
- an explicit `seq` column (`next_seq()`) where rows must keep their order of insertion, rather
  than SQLite's rowid, which PostgreSQL does not have.

A write is `with db.transaction() as tx:`, committed when the block ends and rolled back when it
raises. `tx.lock(table)` makes the transaction the table's only writer until it ends (what checks
a bound and then inserts, atomically across replicas): PostgreSQL's SHARE ROW EXCLUSIVE lock;
SQLite's write transactions already exclude each other (BEGIN IMMEDIATE). `tx.skip_locked` ends a
SELECT that claims rows (`FOR UPDATE SKIP LOCKED` on PostgreSQL, nothing on SQLite).

Schemas are versioned per store (`migrate`): the table `tprt_schema` records each component's
version, and the steps past it run in one transaction under a lock, so replicas that start
together migrate once; a database migrated by a newer tprt is refused with what to do.

A disk that is full is InsufficientStorage (HTTP 507, the server goes on); a PostgreSQL server
that cannot be reached is Unavailable (503), with the store's address, password left out.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from serve.errors import DISK_FULL_MESSAGE, InsufficientStorage, Unavailable, is_disk_full

Row = dict[str, Any]
Step = str | Callable[["Transaction"], None]  # a migration: SQL statements (";"-separated) or code

_SCHEMA_TABLE = "CREATE TABLE IF NOT EXISTS tprt_schema (component TEXT PRIMARY KEY, version BIGINT NOT NULL)"
_seq_lock = threading.Lock()
_last_seq = 0


def next_seq() -> int:
    """A key that orders rows by insertion: nanoseconds since the epoch, strictly increasing
    within this process (replicas' clocks order rows between them)."""
    global _last_seq
    with _seq_lock:
        _last_seq = max(_last_seq + 1, time.time_ns())
        return _last_seq


def insertion_order(table: str) -> Callable[["Transaction"], None]:
    """A migration step: `table` gains the `seq` column (see `next_seq`); the rows of an SQLite
    file from before it keep their order (their rowid)."""
    def step(tx: Transaction) -> None:
        tx.execute(f"ALTER TABLE {table} ADD COLUMN seq BIGINT NOT NULL DEFAULT 0")
        if tx.dialect == "sqlite":
            tx.execute(f"UPDATE {table} SET seq = rowid")
    return step


class StoreError(Exception):
    """A store URL or schema this server cannot use (start-up; the message says what to do)."""


def redact_url(url: str) -> str:
    """The store's address fit for a log or an error: the password replaced by ***."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


class Transaction(ABC):
    """One transaction's statements (see the module docstring)."""

    dialect: str
    skip_locked: str

    @abstractmethod
    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]: ...

    @abstractmethod
    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Runs a statement; returns the rows it changed."""

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        for args in rows:
            self.execute(sql, args)

    @abstractmethod
    def lock(self, table: str) -> None:
        """Makes this transaction `table`'s only writer until it ends."""

    def one(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        rows = self.query(sql, args)
        return rows[0] if rows else None

    def scalar(self, sql: str, args: Sequence[Any] = ()) -> Any:
        row = self.one(sql, args)
        return next(iter(row.values())) if row else None


class Database(ABC):
    """A connection (SQLite) or pool of them (PostgreSQL); thread-safe."""

    dialect: str
    where: str  # for messages: the file, or the redacted URL

    @abstractmethod
    def transaction(self) -> contextlib.AbstractContextManager[Transaction]: ...

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self.transaction() as tx:
            return tx.query(sql, args)

    def one(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        rows = self.query(sql, args)
        return rows[0] if rows else None

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self.transaction() as tx:
            return tx.execute(sql, args)

    @abstractmethod
    def close(self) -> None: ...

    def migrate(self, component: str, steps: Sequence[Step]) -> int:
        """Brings `component`'s tables to version len(steps), running the steps past the version
        the database records; returns the version it found. StoreError when a newer tprt
        migrated it."""
        with self.transaction() as tx:
            self._serialize_migrations(tx)
            tx.execute(_SCHEMA_TABLE)
            found = tx.scalar("SELECT version FROM tprt_schema WHERE component = ?", (component,))
            found = int(found) if found is not None else 0
            if found > len(steps):
                raise StoreError(f"{self.where}: its {component} tables are at schema version {found}, newer than "
                                 f"this tprt's {len(steps)}; run the tprt that wrote them, or a newer one")
            for step in steps[found:]:
                if callable(step):
                    step(tx)
                else:
                    for statement in filter(str.strip, step.split(";")):
                        tx.execute(statement)
            tx.execute("INSERT INTO tprt_schema (component, version) VALUES (?, ?) ON CONFLICT (component) "
                       "DO UPDATE SET version = excluded.version", (component, len(steps)))
        return found

    def _serialize_migrations(self, tx: Transaction) -> None:
        """Makes concurrent `migrate` calls (replicas starting together) run one after another."""


@contextlib.contextmanager
def _disk_full_is_507(where: str) -> Iterator[None]:
    try:
        yield
    except (sqlite3.Error, OSError) as e:
        if is_disk_full(e):
            raise InsufficientStorage(f"{DISK_FULL_MESSAGE} (the store {where}: {e})") from e
        raise


class _SqliteTransaction(Transaction):
    dialect, skip_locked = "sqlite", ""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return [dict(r) for r in self.db.execute(sql, tuple(args)).fetchall()]

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        return int(self.db.execute(sql, tuple(args)).rowcount)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.db.executemany(sql, [tuple(r) for r in rows])

    def lock(self, table: str) -> None:
        """Nothing to do: BEGIN IMMEDIATE made this the database's only writer."""


class SqliteDatabase(Database):
    """One SQLite file, one connection behind a lock (SQLite runs one writer at a time anyway);
    WAL, so other processes' readers are not blocked; every transaction BEGIN IMMEDIATE, so two
    processes on one file never interleave a check and a write."""

    dialect = "sqlite"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = str(self.path.name)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        with self._lock, _disk_full_is_507(self.where):
            self._db.execute("PRAGMA journal_mode=WAL")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        with self._lock, _disk_full_is_507(self.where):
            if self._db.in_transaction:  # nested (a store's method calling another): one transaction
                yield _SqliteTransaction(self._db)
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTransaction(self._db)
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _PostgresTransaction(Transaction):
    dialect, skip_locked = "postgresql", " FOR UPDATE SKIP LOCKED"

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    @staticmethod
    def _sql(sql: str) -> str:
        return sql.replace("%", "%%").replace("?", "%s")

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self.conn.cursor() as cur:
            cur.execute(self._sql(sql), tuple(args))
            return list(cur.fetchall())

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self.conn.cursor() as cur:
            cur.execute(self._sql(sql), tuple(args))
            return int(cur.rowcount)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self.conn.cursor() as cur:
            cur.executemany(self._sql(sql), [tuple(r) for r in rows])

    def lock(self, table: str) -> None:
        # Conflicts with itself and with every INSERT/UPDATE/DELETE; plain SELECTs go on.
        self.execute(f"LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE")


class PostgresDatabase(Database):
    """A pool of psycopg connections to one PostgreSQL database."""

    dialect = "postgresql"

    def __init__(self, url: str, max_connections: int = 8, connect_timeout_s: float = 30.0) -> None:
        try:
            import psycopg
            import psycopg_pool
            from psycopg.rows import dict_row
        except ImportError as e:
            raise StoreError(f"--store {redact_url(url)} needs psycopg: pip install 'tprt[fleet]' ({e})") from e
        self._psycopg = psycopg
        self._pool_timeout = psycopg_pool.PoolTimeout
        self.where = redact_url(url)
        self._pool = psycopg_pool.ConnectionPool(url, min_size=1, max_size=max_connections, open=False,
                                                 timeout=connect_timeout_s, kwargs={"row_factory": dict_row},
                                                 name="tprt-store")
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except psycopg_pool.PoolTimeout as e:
            self._pool.close()
            raise StoreError(f"--store {self.where}: cannot connect within {connect_timeout_s:g} s; is the server "
                             "up, and the address, user and password right?") from e

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        errors = self._psycopg.errors
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield _PostgresTransaction(conn)
        except errors.DiskFull as e:  # before OperationalError, its base
            raise InsufficientStorage(f"{DISK_FULL_MESSAGE} (the store {self.where}: {e})") from e
        except (self._psycopg.OperationalError, self._pool_timeout) as e:
            raise Unavailable(f"the store {self.where} cannot be reached: {e}") from e

    def _serialize_migrations(self, tx: Transaction) -> None:
        tx.execute("SELECT pg_advisory_xact_lock(7436785)")  # any fixed key: tprt's migrations

    def close(self) -> None:
        self._pool.close()


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and str(url).split(":", 1)[0] in ("postgresql", "postgres")


class Stores:
    """Where the server's stores live: PostgreSQL when --store names one (one pool shared by every
    store), else an SQLite file per store under the data dir (the names earlier releases used)."""

    def __init__(self, data_dir: str | Path, url: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.url = url
        if url and not is_postgres_url(url):
            raise StoreError(f"--store {redact_url(url)}: expected a postgresql:// URL (or no --store, for SQLite "
                             "files under --data-dir)")
        self._shared: Database | None = PostgresDatabase(url) if url else None
        self._opened: list[Database] = []

    @property
    def shared(self) -> bool:
        """Whether other replicas may use the same stores."""
        return self._shared is not None

    def open(self, sqlite_name: str) -> Database:
        if self._shared is not None:
            return self._shared
        db = SqliteDatabase(self.data_dir / sqlite_name)
        self._opened.append(db)
        return db

    def close(self) -> None:
        for db in self._opened:
            db.close()
        if self._shared is not None:
            self._shared.close()
