"""OpenAI's Batch API (`/v1/batches`): a JSONL file of requests to chat completions, completions
or responses, run behind interactive traffic, surviving a restart.

A batch is created from an uploaded file (purpose "batch"): every line is checked first
(`read_batch_file`: a JSON object with a unique `custom_id`, `method` POST, the batch's `url`, a
`body` object), so a bad file is a 400 naming its line, and a copy of it is kept in the batch's
directory (`--data-dir/batches/<id>/`). The batch object lives in `--data-dir/batches.sqlite`.

`BatchRunner` (one thread) runs the batches in creation order, a few requests at a time: each is
handed to the generation core at BACKGROUND priority (serve/core/loop.py,
tprt.engine.scheduler), so it queues behind every interactive request and runs in the room they
leave; a request that arrives meanwhile preempts it rather than waits. Each result is appended to
the batch's `output.jsonl` (2xx) or `errors.jsonl` as it ends (OpenAI's line shape: id,
custom_id, response {status_code, request_id, body}, error), and the counts are stored. A
restart resumes every unfinished batch: the lines already answered (their custom_ids in those
files; a line cut by a crash is dropped) are not run again. At the end the two files become
files of purpose "batch_output" (output_file_id, error_file_id) and the batch is completed;
cancelling stops new requests, cancels those running, and keeps what finished. A batch not done
within its completion window (24h) expires the same way.

In a fleet (replicas sharing one store), a batch is run by one replica at a time: the one that
created it, holding a lease in its row that the runner renews (`--job-lease`, as jobs do). With
--artifacts its input is published when it is created, and its results files as they grow (at
each renewal). When a replica dies, its leases lapse, and another replica takes its unfinished
batches over: it fetches their files and resumes them as a restart would, so the lines answered
since the last publish run again (their results are written once). A replica that stalls past
its lease and wakes up finds its next write refused, and leaves the batch to the new owner.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.store.artifacts import Artifacts
from serve.store.database import Database, SqliteDatabase, insertion_order, next_seq
from serve.errors import Cancelled, FailedPrecondition, NotFound, Unavailable, echo
from serve.openai.requests import KnownFields, ParamError

log = logging.getLogger("tprt.serve")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
WINDOW_S = 24 * 3600
MAX_LINES = 50_000  # OpenAI's limit per batch
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")

# A request of the batch: (url, body, gone) -> (HTTP status, response body). `gone()` says, while it
# runs, why it should stop ("client": the batch was cancelled or the runner stops; None: go on).
# Raises Cancelled when it stopped so, Unavailable when the server cannot serve it: either way it
# is not answered (and runs again after a restart).
RunLine = Callable[[str, dict[str, Any], Callable[[], str | None]], tuple[int, dict[str, Any]]]


class BatchBody(KnownFields):
    REFUSED = {"output_expires_after": ("output files are kept until deleted; ask without it", ())}

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: Any = None


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    body: dict[str, Any]


def read_batch_file(path: Path, endpoint: str, param: str = "input_file_id") -> list[BatchLine]:
    """Every request of a batch input file, checked: a 400 naming the file and the line."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"line {n}"
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise ParamError(f"{where} is not JSON ({e})", param) from None
            if not isinstance(obj, dict):
                raise ParamError(f"{where}: expected a JSON object", param)
            custom_id, method, url, body = obj.get("custom_id"), obj.get("method"), obj.get("url"), obj.get("body")
            if not isinstance(custom_id, str) or not custom_id:
                raise ParamError(f"{where}: custom_id must be a non-empty string", param)
            if custom_id in seen:
                raise ParamError(f"{where}: custom_id {echo(custom_id)} is used twice; each must be unique", param)
            if method != "POST":
                raise ParamError(f"{where}: method must be POST", param)
            if url != endpoint:
                raise ParamError(f"{where}: url {echo(str(url))} is not the batch's endpoint {endpoint}", param)
            if not isinstance(body, dict):
                raise ParamError(f"{where}: body must be a JSON object", param)
            if body.get("stream"):
                raise ParamError(f"{where}: a batch's requests cannot stream", param)
            seen.add(custom_id)
            lines.append(BatchLine(custom_id, body))
            if len(lines) > MAX_LINES:
                raise ParamError(f"more than {MAX_LINES} requests; split the file", param)
    if not lines:
        raise ParamError("the file holds no requests", param)
    return lines


def _answered(path: Path) -> tuple[set[str], int]:
    """The custom_ids a results file answers, and its length up to its last whole line (a crash
    mid-write leaves a cut line, dropped)."""
    done: set[str] = set()
    good = 0
    if not path.exists():
        return done, 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                done.add(json.loads(raw)["custom_id"])
            except (ValueError, KeyError, TypeError):
                break
            good += len(raw)
    return done, good


class BatchStore:
    """The batch objects, one JSON object per row of the `batches` table (serve/store:
    `--data-dir/batches.sqlite`, or PostgreSQL shared by replicas). With `owner` (a replica of a
    fleet), the batches this store runs are those that replica holds the lease of: those it
    created, and those it took over from a replica whose lease lapsed (`take_over`)."""

    MIGRATIONS = ("CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, created DOUBLE PRECISION NOT NULL, "
                  "status TEXT NOT NULL, object TEXT NOT NULL)",
                  insertion_order("batches"),
                  "ALTER TABLE batches ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
                  "ALTER TABLE batches ADD COLUMN lease_until_ms BIGINT NOT NULL DEFAULT 0")

    def __init__(self, data_dir: Path, db: Database | None = None, owner: str | None = None,
                 lease_ms: int = 30_000) -> None:
        self.db = db if db is not None else SqliteDatabase(Path(data_dir) / "batches.sqlite")
        self.db.migrate("batches", self.MIGRATIONS)
        self.owner = owner
        self.lease_ms = lease_ms

    def put(self, obj: dict[str, Any]) -> None:
        """Stores a batch (its insertion order, owner and lease kept from its first put)."""
        self.db.execute("INSERT INTO batches (id, created, status, object, seq, owner, lease_until_ms) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?) "
                        "ON CONFLICT (id) DO UPDATE SET status = excluded.status, object = excluded.object",
                        (obj["id"], obj["created_at"], obj["status"], json.dumps(obj), next_seq(), self.owner or "",
                         _now_ms() + self.lease_ms))

    def save(self, obj: dict[str, Any]) -> bool:
        """The runner's write of a batch's progress, read and written under the row's lock: a
        cancellation stored meanwhile (through the API, on any replica) is kept, `obj` taking it
        over. False when this replica no longer holds the batch (its lease lapsed and another
        replica took it over); nothing is written then."""
        with self.db.transaction() as tx:
            lock = " FOR UPDATE" if tx.dialect == "postgresql" else ""  # SQLite's writers exclude each other
            row = tx.one(f"SELECT object, owner FROM batches WHERE id = ?{lock}", (obj["id"],))
            if row is None or (self.owner and row["owner"] != self.owner):
                return False
            stored = json.loads(row["object"])
            if stored["status"] == "cancelling" and obj["status"] == "in_progress":
                obj.update(status="cancelling", cancelling_at=stored["cancelling_at"])
            tx.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?",
                       (obj["status"], json.dumps(obj), obj["id"]))
        return True

    def renew(self) -> None:
        """Extends the leases of this replica's unfinished batches."""
        if self.owner:
            self.db.execute(f"UPDATE batches SET lease_until_ms = ? WHERE owner = ? AND status IN ({_ACTIVE_SQL})",
                            (_now_ms() + self.lease_ms, self.owner, *ACTIVE))

    def take_over(self) -> list[tuple[str, str]]:
        """Claims every unfinished batch whose owner's lease lapsed; returns (batch id, the
        replica it was taken from) for each. A row is claimed by one replica only: the update's
        condition is checked again under the row's lock."""
        if not self.owner:
            return []
        now = _now_ms()
        lapsed = self.db.query(f"SELECT id, owner FROM batches WHERE status IN ({_ACTIVE_SQL}) AND owner != ? "
                               "AND lease_until_ms < ?", (*ACTIVE, self.owner, now))
        taken = []
        for row in lapsed:
            if self.db.execute("UPDATE batches SET owner = ?, lease_until_ms = ? WHERE id = ? AND owner = ? "
                               "AND lease_until_ms < ?", (self.owner, now + self.lease_ms, row["id"], row["owner"],
                                                          now)) == 1:
                taken.append((row["id"], row["owner"]))
        return taken

    def get(self, batch_id: str, param: str = "batch_id") -> dict[str, Any]:
        row = self.db.one("SELECT object FROM batches WHERE id = ?", (batch_id,))
        if row is None:
            raise NotFound(f"no batch {echo(batch_id)}", param)
        return dict(json.loads(row["object"]))

    def page(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first: up to `limit` after the batch `after`; and whether there are more."""
        with self.db.transaction() as tx:
            if after is not None:
                mark = tx.one("SELECT created, seq FROM batches WHERE id = ?", (after,))
                if mark is None:
                    raise NotFound(f"no batch {echo(after)}", "after")
                rows = tx.query("SELECT object FROM batches WHERE created < ? OR (created = ? AND seq < ?) "
                                "ORDER BY created DESC, seq DESC LIMIT ?",
                                (mark["created"], mark["created"], mark["seq"], limit + 1))
            else:
                rows = tx.query("SELECT object FROM batches ORDER BY created DESC, seq DESC LIMIT ?", (limit + 1,))
        objs = [json.loads(r["object"]) for r in rows]
        return objs[:limit], len(objs) > limit

    def active(self) -> list[dict[str, Any]]:
        """Unfinished batches (this replica's, with an owner), oldest first."""
        mine, args = (" AND owner = ?", (*ACTIVE, self.owner)) if self.owner else ("", ACTIVE)
        rows = self.db.query(f"SELECT object FROM batches WHERE status IN ({_ACTIVE_SQL}){mine} "
                             "ORDER BY created, seq", args)
        return [json.loads(r["object"]) for r in rows]


_ACTIVE_SQL = ",".join("?" * len(ACTIVE))


def _now_ms() -> int:
    return int(time.time() * 1000)


class _LeaseLost(Exception):
    """Another replica took the batch over (this one stalled past its lease)."""


def new_batch(body: BatchBody, lines: int, model: str | None) -> dict[str, Any]:
    now = int(time.time())
    return {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": body.endpoint, "errors": None,
            "input_file_id": body.input_file_id, "completion_window": body.completion_window,
            "status": "in_progress", "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": now, "expires_at": now + WINDOW_S, "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": lines, "completed": 0, "failed": 0}, "metadata": body.metadata or {},
            "model": model, "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
                                      "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                                      "total_tokens": 0}}


class BatchRunner:
    """Runs the stored batches on a thread of its own (see the module docstring)."""

    def __init__(self, store: BatchStore, data_dir: Path, concurrency: int = 4,
                 artifacts: Artifacts | None = None) -> None:
        self.store = store
        self.data_dir = Path(data_dir)
        self.dir = self.data_dir / "batches"
        self.artifacts = artifacts  # a fleet's: inputs and results published for a takeover
        self._renew_at = 0.0  # monotonic time of the next lease renewal (a fleet's)
        self._published: dict[str, int] = {}  # results file -> the size last published
        self.run_line: RunLine | None = None  # `bind`
        self.publish: Callable[[Path, str], str] | None = None
        self.concurrency = max(1, concurrency)
        self._cv = threading.Condition()
        self._stop = False
        self._cancel: set[str] = set()
        self._thread: threading.Thread | None = None
        self.accepting = True

    def bind(self, run_line: RunLine, publish: Callable[[Path, str], str]) -> None:
        """How a request is run (the HTTP app's endpoints) and a results file kept (its file store)."""
        self.run_line, self.publish = run_line, publish

    # ----------------------------------------------------------------- the API's side

    def input_path(self, batch_id: str) -> Path:
        return self.dir / batch_id / "input.jsonl"

    def submit(self, obj: dict[str, Any], input_file: Path) -> dict[str, Any]:
        """Stores a new batch (its input copied into its directory) for the runner."""
        if not self.accepting:
            raise Unavailable("the server is shutting down; create the batch on another replica")
        path = self.input_path(obj["id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(input_file.read_bytes())
        tmp.replace(path)
        if self.artifacts is not None:  # whoever takes the batch over reads it from there
            self.artifacts.publish(self._name(path))
        self.store.put(obj)
        with self._cv:
            self._cv.notify_all()
        return obj

    def cancel(self, batch_id: str) -> dict[str, Any]:
        with self._cv:
            obj = self.store.get(batch_id)
            if obj["status"] in TERMINAL:
                raise FailedPrecondition(f"batch {batch_id} is already {obj['status']}", "batch_id")
            if obj["status"] != "cancelling":
                obj.update(status="cancelling", cancelling_at=int(time.time()))
                self.store.put(obj)
            self._cancel.add(batch_id)
            self._cv.notify_all()
        return obj

    # ----------------------------------------------------------------- the thread

    def start(self) -> None:
        assert self.run_line is not None, "bind() first"
        self._thread = threading.Thread(target=self._run, name="tprt-batches", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops taking requests; those running end with the server's drain and run again after a
        restart (nothing of them is written)."""
        self.accepting = False
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        idle_s = min(5.0, self.store.lease_ms / 3000) if self.store.owner else 5.0
        while True:
            self._heartbeat(None)
            for batch_id, owner in self.store.take_over():
                self._taken_over(batch_id, owner)
            with self._cv:
                if self._stop:
                    return
                active = self.store.active()
                if not active:
                    self._cv.wait(idle_s)
                    continue
            try:
                self._run_batch(active[0])
            except _LeaseLost:
                log.warning("batch %s: another replica took it over (this one stalled past its lease); leaving it",
                            active[0]["id"])
            except Exception:  # noqa: BLE001 - a bug in one batch must not end the runner
                log.exception("batch %s failed", active[0]["id"])
                self._fail(active[0]["id"], "the batch failed on the server; see its log")

    def _fail(self, batch_id: str, message: str) -> None:
        obj = self.store.get(batch_id)
        obj.update(status="failed", failed_at=int(time.time()),
                   errors={"object": "list", "data": [{"code": "server_error", "message": message, "param": None,
                                                       "line": None}]})
        self.store.save(obj)

    # ----------------------------------------------------------------- a fleet's leases

    def _name(self, path: Path) -> str:
        return path.relative_to(self.data_dir).as_posix()

    def _heartbeat(self, running: str | None) -> None:
        """Renews this replica's leases every third of the lease, and publishes the running
        batch's results files where they grew (a fleet's; nothing for one server)."""
        if not self.store.owner or time.monotonic() < self._renew_at:
            return
        self._renew_at = time.monotonic() + self.store.lease_ms / 3000
        self.store.renew()
        if self.artifacts is None or running is None:
            return
        for path in (self.dir / running / "output.jsonl", self.dir / running / "errors.jsonl"):
            size = path.stat().st_size if path.exists() else 0
            if size and self._published.get(str(path)) != size:
                try:
                    self.artifacts.publish(self._name(path))  # a line cut mid-copy is dropped on resume
                    self._published[str(path)] = size
                except (OSError, Unavailable) as e:
                    log.warning("batch %s: its results were not published (%s); a takeover runs more lines again",
                                running, e)

    def _taken_over(self, batch_id: str, owner: str) -> None:
        """Brings a batch taken over from `owner` here (its input, and the results published)."""
        work = self.dir / batch_id
        try:
            if self.artifacts is not None:
                for name in ("input.jsonl", "output.jsonl", "errors.jsonl"):
                    self.artifacts.fetch(self._name(work / name))
        except (OSError, Unavailable) as e:
            log.warning("batch %s: its files could not be fetched (%s); retrying at the next poll", batch_id, e)
            self.store.renew()  # held meanwhile
            return
        if not self.input_path(batch_id).exists():
            self._fail(batch_id, f"replica {owner or '(unnamed)'} stopped, and its input is not readable here; give "
                                 "the replicas the same --artifacts, or one shared --data-dir")
            return
        log.warning("batch %s: replica %s stopped renewing its lease; resuming it here", batch_id, owner or "(unnamed)")

    def _save(self, obj: dict[str, Any]) -> None:
        if not self.store.save(obj):
            raise _LeaseLost(obj["id"])

    def _run_batch(self, obj: dict[str, Any]) -> None:
        batch_id = obj["id"]
        work = self.dir / batch_id
        outputs, errors = work / "output.jsonl", work / "errors.jsonl"
        done_ok, ok_len = _answered(outputs)
        done_err, err_len = _answered(errors)
        for path, length in ((outputs, ok_len), (errors, err_len)):
            if path.exists() and path.stat().st_size != length:
                with open(path, "r+b") as f:
                    f.truncate(length)
        obj["request_counts"].update(completed=len(done_ok), failed=len(done_err))
        if obj["status"] in ("validating", "in_progress"):
            lines = read_batch_file(self.input_path(batch_id), obj["endpoint"])
            todo = [line for line in lines if line.custom_id not in done_ok and line.custom_id not in done_err]
            self._run_lines(obj, todo, outputs, errors)
        with self._cv:
            if self._stop:
                return
        self._finalize(obj, outputs, errors)

    def _stopped(self, batch_id: str) -> str | None:
        """Why the batch stops taking requests now: "stop" (the server), "cancelled", "expired"."""
        with self._cv:
            if self._stop:
                return "stop"
            if batch_id in self._cancel:
                return "cancelled"
        obj = self.store.get(batch_id)
        if obj["status"] == "cancelling":
            return "cancelled"
        return "expired" if time.time() > obj["expires_at"] else None

    def _run_lines(self, obj: dict[str, Any], todo: list[BatchLine], outputs: Path, errors: Path) -> None:
        batch_id, url = obj["id"], obj["endpoint"]
        write = threading.Lock()

        def gone() -> str | None:
            return "client" if self._stopped(batch_id) in ("stop", "cancelled") else None

        with open(outputs, "ab") as out, open(errors, "ab") as err, \
                ThreadPoolExecutor(self.concurrency, thread_name_prefix="tprt-batch") as pool:
            running: set[Future[None]] = set()
            pending = iter(todo)
            while True:
                self._heartbeat(batch_id)
                why = self._stopped(batch_id)
                while why is None and len(running) < self.concurrency and (line := next(pending, None)) is not None:
                    running.add(pool.submit(self._one, obj, url, line, gone, out, err, write))
                if not running:
                    break
                finished, running = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                for f in finished:
                    f.result()  # _one answers every request; what escapes is a bug
            if why == "expired":
                obj.update(status="expired", expired_at=int(time.time()))
            self._save(self._merged(obj))

    def _one(self, obj: dict[str, Any], url: str, line: BatchLine, gone: Callable[[], str | None], out: Any,
             err: Any, write: threading.Lock) -> None:
        assert self.run_line is not None, "bind() first"
        try:
            status, body = self.run_line(url, line.body, gone)
        except Cancelled:
            return  # the batch was cancelled, or the runner stops
        except Unavailable as e:  # the server drains or cannot generate: stop, resume after a restart
            log.info("batch %s pauses: %s", obj["id"], e)
            with self._cv:
                self._stop = True
            return
        request_id = "batch_req_" + secrets.token_hex(12)
        record = {"id": request_id, "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}
        data = (json.dumps(record) + "\n").encode()
        ok = 200 <= status < 300
        with write:
            target = out if ok else err
            target.write(data)
            target.flush()
            obj["request_counts"]["completed" if ok else "failed"] += 1
            if ok and isinstance(body.get("usage"), dict):
                _add_usage(obj["usage"], body["usage"])
            self._save(self._merged(obj))

    def _merged(self, obj: dict[str, Any]) -> dict[str, Any]:
        """`obj` with the stored status's changes (a cancellation made meanwhile) kept."""
        stored = self.store.get(obj["id"])
        if stored["status"] == "cancelling" and obj["status"] == "in_progress":
            obj.update(status="cancelling", cancelling_at=stored["cancelling_at"])
        return obj

    def _finalize(self, obj: dict[str, Any], outputs: Path, errors: Path) -> None:
        obj = self._merged(obj)
        end = {"cancelling": "cancelled", "expired": "expired"}.get(obj["status"], "completed")
        if obj["status"] not in ("finalizing",):
            obj.update(finalizing_at=int(time.time()))
            if end == "completed":
                obj["status"] = "finalizing"
            self._save(obj)
        for path, key in ((outputs, "output_file_id"), (errors, "error_file_id")):
            if obj.get(key) is None and path.exists() and path.stat().st_size > 0:
                assert self.publish is not None, "bind() first"
                obj[key] = self.publish(path, f"{obj['id']}_{'output' if key == 'output_file_id' else 'error'}.jsonl")
                self._save(obj)
        now = int(time.time())
        obj["status"] = end
        obj[{"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[end]] = now
        self._save(obj)
        with self._cv:
            self._cancel.discard(obj["id"])
        log.info("batch %s %s: %d completed, %d failed", obj["id"], end, obj["request_counts"]["completed"],
                 obj["request_counts"]["failed"])


def _add_usage(total: dict[str, Any], usage: dict[str, Any]) -> None:
    """Adds a chat/completions or responses usage to a batch's (the Responses API's names)."""
    inp = usage.get("input_tokens", usage.get("prompt_tokens", 0)) or 0
    outp = usage.get("output_tokens", usage.get("completion_tokens", 0)) or 0
    cached = (usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    total["input_tokens"] += inp
    total["output_tokens"] += outp
    total["total_tokens"] += inp + outp
    total["input_tokens_details"]["cached_tokens"] += cached or 0
