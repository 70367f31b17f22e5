"""Stored Responses (`store: true`): the `responses` table of the server's database (serve/store:
`--data-dir/responses.sqlite`, or PostgreSQL shared by replicas), one row per response with the
response object, its input items and the conversation a continuation starts from.

Bounded like the job store: at most `max_stored` responses (--max-stored-responses); storing one
more deletes the oldest. A write that does not fit the disk is refused before it starts
(serve/jobs/storage.py) and SQLite's own "disk full" is the same 507, the server goes on.
Rows are read and written on the route's worker thread.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from serve.errors import NotFound, echo
from serve.jobs.storage import ensure_room
from serve.store.database import Database, SqliteDatabase, insertion_order, next_seq

DEFAULT_MAX_STORED = 10_000

MIGRATIONS = ("""CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, created DOUBLE PRECISION NOT NULL, response TEXT NOT NULL, input_items TEXT NOT NULL,
    conversation TEXT NOT NULL
)""", insertion_order("responses"))


class ResponseStore:
    """See the module docstring."""

    def __init__(self, data_dir: Path, max_stored: int = DEFAULT_MAX_STORED, db: Database | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.max_stored = max_stored
        self.db = db if db is not None else SqliteDatabase(self.data_dir / "responses.sqlite")
        self.db.migrate("responses", MIGRATIONS)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            conversation: list[dict[str, Any]]) -> None:
        """Stores a finished response (replacing one of the same id), then drops the oldest beyond
        the bound."""
        row = (response["id"], time.time(), json.dumps(response), json.dumps(input_items), json.dumps(conversation),
               next_seq())
        ensure_room(self.data_dir, sum(len(x) for x in row[2:5]))
        with self.db.transaction() as tx:
            tx.lock("responses")
            tx.execute("INSERT INTO responses (id, created, response, input_items, conversation, seq) "
                       "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET created = excluded.created, "
                       "response = excluded.response, input_items = excluded.input_items, "
                       "conversation = excluded.conversation, seq = excluded.seq", row)
            tx.execute("DELETE FROM responses WHERE id NOT IN (SELECT id FROM responses ORDER BY created DESC, "
                       "seq DESC LIMIT ?)", (self.max_stored,))

    def _row(self, response_id: str, column: str, field: str) -> Any:
        row = self.db.one(f"SELECT {column} FROM responses WHERE id = ?", (response_id,))
        if row is None:
            raise NotFound(f"no stored response {echo(response_id)} (it was not stored, was deleted, or was the "
                           f"oldest of more than {self.max_stored})", field)
        return row[column]

    def get(self, response_id: str, field: str = "response_id") -> dict[str, Any]:
        return dict(json.loads(self._row(response_id, "response", field)))

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        return list(json.loads(self._row(response_id, "input_items", "response_id")))

    def conversation(self, response_id: str, field: str = "previous_response_id") -> list[dict[str, Any]]:
        """The items a response continuing `response_id` starts from."""
        return list(json.loads(self._row(response_id, "conversation", field)))

    def delete(self, response_id: str) -> None:
        if not self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,)):
            raise NotFound(f"no stored response {echo(response_id)}", "response_id")

    def count(self) -> int:
        return int(self.db.query("SELECT COUNT(*) AS n FROM responses")[0]["n"])
