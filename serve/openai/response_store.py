"""Stored Responses (`store: true`): `--data-dir/responses.sqlite`, one row per response with
the response object, its input items and the conversation a continuation starts from.

Bounded like the job store: at most `max_stored` responses (--max-stored-responses); storing one
more deletes the oldest. A write that does not fit the disk is refused before it starts
(serve/jobs/storage.py) and SQLite's own "disk full" is the same 507, the server goes on.
Rows are read and written on the route's worker thread (one connection per call; SQLite's WAL
lets readers and the writer overlap).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from serve.errors import NotFound, echo
from serve.jobs.storage import ensure_room

DEFAULT_MAX_STORED = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL
)"""


class ResponseStore:
    """See the module docstring."""

    def __init__(self, data_dir: Path, max_stored: int = DEFAULT_MAX_STORED) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / "responses.sqlite"
        self.max_stored = max_stored
        self._write = threading.Lock()
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            yield db
        finally:
            db.close()

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            conversation: list[dict[str, Any]]) -> None:
        """Stores a finished response (replacing one of the same id), then drops the oldest beyond
        the bound."""
        row = (response["id"], time.time(), json.dumps(response), json.dumps(input_items), json.dumps(conversation))
        ensure_room(self.data_dir, sum(len(x) for x in row[2:]))
        with self._write, self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)", row)
                db.execute("DELETE FROM responses WHERE id NOT IN (SELECT id FROM responses ORDER BY created DESC, "
                           "rowid DESC LIMIT ?)", (self.max_stored,))
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _row(self, response_id: str, columns: str, field: str) -> tuple[Any, ...]:
        with self._connect() as db:
            row = db.execute(f"SELECT {columns} FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            raise NotFound(f"no stored response {echo(response_id)} (it was not stored, was deleted, or was the "
                           f"oldest of more than {self.max_stored})", field)
        return row

    def get(self, response_id: str, field: str = "response_id") -> dict[str, Any]:
        return json.loads(self._row(response_id, "response", field)[0])

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        return json.loads(self._row(response_id, "input_items", "response_id")[0])

    def conversation(self, response_id: str, field: str = "previous_response_id") -> list[dict[str, Any]]:
        """The items a response continuing `response_id` starts from."""
        return json.loads(self._row(response_id, "conversation", field)[0])

    def delete(self, response_id: str) -> None:
        with self._write, self._connect() as db:
            gone = db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount
        if not gone:
            raise NotFound(f"no stored response {echo(response_id)}", "response_id")

    def count(self) -> int:
        with self._connect() as db:
            return int(db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])
