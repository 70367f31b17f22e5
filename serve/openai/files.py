"""Files of the OpenAI API (`/v1/files`): fine-tuning datasets (purpose "fine-tune"), batch
inputs ("batch": JSONL of request objects, each checked in full when a batch is made of it,
serve/openai/batches.py) and the results of batches ("batch_output", written by the server).

A file is its bytes, `--data-dir/files/<id>.jsonl`, and its OpenAI file object, a row of the
`files` table in the server's database (serve/store: `--data-dir/files.sqlite`, or PostgreSQL
shared by a fleet's replicas, so that every replica lists, reads and deletes every file). The
bytes are written to a temporary name, synced and renamed into place, and (with --artifacts)
published to the artifact store, before the row is written: a file is listed only once its data
can be read from anywhere. Another replica asked for a file's content, or creating a job or a
batch from it, fetches it from the artifact store first (checked against its checksums).

What a crash leaves half-done (a temporary upload, data without its row) was never listed, and
a later start removes it (on a data dir other replicas share, only once it is an hour old: it may
be another replica's upload in progress). A dataset is checked before it is kept, line by line as
training reads it (tprt.train.data: JSON objects with `text`, `prompt`/`completion` or chat
`messages`, tokenized with the served model's tokenizer), so a bad line is a 400 naming the file
and line at upload, not a failed job later.

A job names its file by the data path (`files/<id>.jsonl`, serve/openai/jobs.py), which the
job store keeps; a file that a queued or running job will read cannot be deleted. Earlier
releases kept each object as `files/<id>.json`; those are moved into the table at start-up.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import IO, Any

from serve.errors import FailedPrecondition, NotFound, Unavailable, echo
from serve.jobs.store import JobStore
from serve.openai.requests import ParamError, PayloadTooLarge
from serve.jobs.storage import ensure_quota, ensure_room
from serve.store.artifacts import Artifacts
from serve.store.database import Database, SqliteDatabase, next_seq
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer

log = logging.getLogger("tprt.serve")

FILES_DIR = "files"
PURPOSE = "fine-tune"
BATCH_PURPOSE = "batch"
UPLOAD_PURPOSES = (PURPOSE, BATCH_PURPOSE)
_FILE_ID = re.compile(r"file-[0-9a-f]{24}")
_COPY_CHUNK = 1 << 20


def dataset_path(file_id: str) -> str:
    """Where a file's bytes are, relative to --data-dir (the `dataset` a job stores)."""
    return f"{FILES_DIR}/{file_id}.jsonl"


def _size_of(upload: IO[bytes]) -> int:
    """The size of a seekable upload (Starlette spools it), else 0: the copy is then the check."""
    try:
        here = upload.tell()
        size = upload.seek(0, os.SEEK_END) - here
        upload.seek(here)
        return max(0, size)
    except (OSError, ValueError, AttributeError):
        return 0


def file_of_dataset(dataset: str) -> str | None:
    """The file id a job's dataset path names, when it is an uploaded file."""
    m = re.fullmatch(rf"{FILES_DIR}/(file-[0-9a-f]{{24}})\.jsonl", dataset)
    return m.group(1) if m else None


MIGRATIONS = ("""CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, created_at BIGINT NOT NULL, purpose TEXT NOT NULL, bytes BIGINT NOT NULL,
    object TEXT NOT NULL, seq BIGINT NOT NULL
)""",)
SHARED_SWEEP_AGE_S = 3600.0  # on a shared data dir, leftovers younger than this may be uploads in progress


class FileStore:
    """The uploaded files: their rows in `db`, their bytes under `data_dir/files/` (thread-safe)."""

    def __init__(self, data_dir: Path, tokenizer: Tokenizer | None, context_length: int, max_bytes: int,
                 jobs: JobStore, max_stored_bytes: int | None = None, artifacts: Artifacts | None = None,
                 db: Database | None = None, shared: bool = False) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.artifacts = artifacts  # --artifacts: files published for the other replicas
        self.dir = self.data_dir / FILES_DIR
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.max_bytes = max_bytes
        self.jobs = jobs
        self.max_stored_bytes = max_stored_bytes  # --max-stored-bytes: every upload's bytes together
        self.db = db if db is not None else SqliteDatabase(self.data_dir / "files.sqlite")
        self.db.migrate("files", MIGRATIONS)
        # Held by a delete, and by a job's creation from finding its file to storing the job:
        # a file is never deleted under a job that was just accepted.
        self.lock = threading.Lock()
        self._import_objects()
        self._sweep(SHARED_SWEEP_AGE_S if shared else 0.0)

    def _import_objects(self) -> None:
        """Moves the file objects earlier releases kept as `files/<id>.json` into the table."""
        for path in sorted(self.dir.glob("file-*.json")) if self.dir.is_dir() else ():
            if not _FILE_ID.fullmatch(path.stem):
                continue
            try:
                obj = json.loads(path.read_text())
                self._insert(obj)
            except (ValueError, KeyError, TypeError):
                log.warning("files/%s: not a file object; left as it is", path.name)
                continue
            path.unlink(missing_ok=True)

    def _sweep(self, min_age_s: float) -> None:
        """Removes what a crash mid-upload left, at least `min_age_s` old: temporary uploads, and
        data whose row was never written (such a file was never listed, so no client or job knows
        its id) or was deleted through another replica."""
        if not self.dir.is_dir():
            return
        known = {row["id"] for row in self.db.query("SELECT id FROM files")}
        cutoff = time.time() - min_age_s
        for path in self.dir.iterdir():
            name = path.name
            file_id = name.lstrip(".").split(".", 1)[0]
            leftover = name.endswith(".upload") or (_FILE_ID.fullmatch(file_id) is not None and file_id not in known)
            try:
                if leftover and path.is_file() and path.stat().st_mtime <= cutoff:
                    path.unlink()
            except FileNotFoundError:
                pass

    def add(self, upload: IO[bytes], filename: str, purpose: str) -> dict[str, Any]:
        """Checks and keeps one uploaded file; returns its file object. Blocking (a thread)."""
        if purpose not in UPLOAD_PURPOSES:
            raise ParamError(f"{echo(purpose)}; this server takes purpose 'fine-tune' or 'batch'", "purpose")
        if self.tokenizer is None and purpose == PURPOSE:
            raise FailedPrecondition("the served model has no tokenizer; fine-tuning datasets need one", "file")
        self.dir.mkdir(parents=True, exist_ok=True)
        need = _size_of(upload)  # refused before a byte is copied when it cannot fit (HTTP 507)
        ensure_quota(self.stored_bytes(), need, self.max_stored_bytes, "--max-stored-bytes")
        ensure_room(self.dir, need)
        file_id = "file-" + secrets.token_hex(12)
        tmp = self.dir / f".{file_id}.upload"
        try:
            size = self._copy(upload, tmp, self.max_bytes)
            if purpose == PURPOSE:
                self._check_dataset(tmp, filename)
            else:
                _check_jsonl(tmp, filename)
            os.replace(tmp, self.data_dir / dataset_path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        return self._keep(file_id, size, filename, purpose)

    def _keep(self, file_id: str, size: int, filename: str, purpose: str) -> dict[str, Any]:
        """Publishes the file's data (with --artifacts), then lists it."""
        if self.artifacts is not None:
            self.artifacts.publish(dataset_path(file_id))
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "status_details": None}
        self._insert(obj)
        return obj

    def _insert(self, obj: dict[str, Any]) -> None:
        self.db.execute("INSERT INTO files (id, created_at, purpose, bytes, object, seq) VALUES (?, ?, ?, ?, ?, ?) "
                        "ON CONFLICT (id) DO NOTHING",
                        (obj["id"], int(obj["created_at"]), obj["purpose"], int(obj["bytes"]), json.dumps(obj),
                         next_seq()))

    def publish(self, path: Path, filename: str) -> str:
        """Keeps a batch's results file (copied, synced and renamed into place) as a file of
        purpose batch_output; returns its id."""
        self.dir.mkdir(parents=True, exist_ok=True)
        size = path.stat().st_size
        ensure_room(self.dir, size)
        file_id = "file-" + secrets.token_hex(12)
        tmp = self.dir / f".{file_id}.upload"
        try:
            with open(path, "rb") as src:
                self._copy(src, tmp, limit=None)
            os.replace(tmp, self.data_dir / dataset_path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        return str(self._keep(file_id, size, filename, "batch_output")["id"])

    def stored_bytes(self) -> int:
        """The bytes of every kept file (their objects say how many)."""
        return int(self.db.query("SELECT COALESCE(SUM(bytes), 0) AS n FROM files")[0]["n"])

    def _copy(self, upload: IO[bytes], tmp: Path, limit: int | None) -> int:
        """Copies (and syncs) `upload` to `tmp`; over `limit` bytes (None: no limit) is a 413."""
        size = 0
        with open(tmp, "wb") as out:
            while chunk := upload.read(_COPY_CHUNK):
                size += len(chunk)
                if limit is not None and size > limit:
                    raise PayloadTooLarge(f"file: over {self.max_bytes} bytes; the server takes datasets of at most "
                                          f"{self.max_bytes} bytes (--max-dataset-bytes)", "file")
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if size == 0:
            raise ParamError("the file is empty", "file")
        return size

    def _check_dataset(self, path: Path, filename: str) -> None:
        from tprt.train.data import load_documents
        from tprt.train.preference import is_preference_file, load_pairs

        assert self.tokenizer is not None
        try:
            check = load_pairs if is_preference_file(path) else load_documents
            check(path, self.tokenizer, self.context_length)
        except ValidationError as e:
            raise ParamError(str(e).replace(str(path), echo(filename)), "file") from None

    def get(self, file_id: str, param: str = "file_id") -> dict[str, Any]:
        """The file object; NotFound naming `param` when there is none."""
        row = self.db.one("SELECT object FROM files WHERE id = ?", (file_id,)) if _FILE_ID.fullmatch(file_id) else None
        if row is None:
            raise NotFound(f"no file {echo(file_id)} (the files endpoint lists them)", param)
        return dict(json.loads(row["object"]))

    def content(self, file_id: str, param: str = "file_id") -> Path:
        """Where the file's bytes are in this data dir, fetched first when another replica took
        the upload; NotFound naming `param` when there is no such file."""
        self.get(file_id, param)
        path = self.data_dir / dataset_path(file_id)
        if not path.exists() and self.artifacts is not None:
            self.artifacts.fetch(dataset_path(file_id))
        if not path.exists():
            raise Unavailable(f"file {file_id}: its data is on the replica that took the upload; give every "
                              "replica the same --artifacts, or one shared --data-dir")
        return path

    def list(self, purpose: str | None = None) -> list[dict[str, Any]]:
        """Every file object, newest first."""
        where, args = ("WHERE purpose = ? ", (purpose,)) if purpose is not None else ("", ())
        rows = self.db.query(f"SELECT object FROM files {where}ORDER BY created_at DESC, id DESC", args)
        return [dict(json.loads(row["object"])) for row in rows]

    def delete(self, file_id: str) -> dict[str, Any]:
        with self.lock:
            self.get(file_id)
            users = self.jobs.using_dataset(dataset_path(file_id))
            if users:
                raise FailedPrecondition(f"job {users[0].id} ({users[0].state}) will read this file; cancel it or "
                                         "wait until it ends", "file_id")
            self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))  # unlisted first: nothing half-deleted shows
            (self.data_dir / dataset_path(file_id)).unlink(missing_ok=True)
            if self.artifacts is not None:
                self.artifacts.remove(dataset_path(file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    def close(self) -> None:
        self.db.close()


def _check_jsonl(path: Path, filename: str) -> None:
    """A batch input is JSONL of objects (what each must hold is checked when a batch is made)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                ok = isinstance(json.loads(raw), dict)
            except (ValueError, RecursionError):
                ok = False
            if not ok:
                raise ParamError(f"{echo(filename)} line {n}: expected a JSON object", "file")
