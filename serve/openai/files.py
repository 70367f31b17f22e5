"""Files of the OpenAI API (`/v1/files`) under `--data-dir/files/`: fine-tuning datasets
(purpose "fine-tune"), batch inputs ("batch": JSONL of request objects, each checked in full when
a batch is made of it, serve/openai/batches.py) and the results of batches ("batch_output",
written by the server).

Each file is two entries: `<id>.jsonl` (the bytes as uploaded) and `<id>.json` (its OpenAI file
object). Both are written to a temporary name, synced and renamed into place, the data first, so
a file is listed once its object exists; what a crash leaves half-done (a temporary upload, data
without its object) was never listed, and the next start removes it. A dataset is
checked before it is kept, line by line as training reads it (tprt.train.data: JSON objects with
`text`, `prompt`/`completion` or chat `messages`, tokenized with the served model's tokenizer),
so a bad line is a 400 naming the file and line at upload, not a failed job later.

A job names its file by the data path (`files/<id>.jsonl`, serve/openai/jobs.py), which the
job store keeps; a file that a queued or running job will read cannot be deleted.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import IO, Any

from serve.errors import FailedPrecondition, NotFound, echo
from serve.jobs.store import JobStore
from serve.openai.requests import ParamError, PayloadTooLarge
from serve.jobs.storage import ensure_quota, ensure_room
from serve.store.artifacts import Artifacts
from tprt.checkpoint.fsutil import write_bytes_atomic
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer

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


class FileStore:
    """The uploaded files under `data_dir/files/` (thread-safe)."""

    def __init__(self, data_dir: Path, tokenizer: Tokenizer | None, context_length: int, max_bytes: int,
                 jobs: JobStore, max_stored_bytes: int | None = None, artifacts: Artifacts | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.artifacts = artifacts  # --artifacts: uploads published for the other replicas' jobs
        self.dir = self.data_dir / FILES_DIR
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.max_bytes = max_bytes
        self.jobs = jobs
        self.max_stored_bytes = max_stored_bytes  # --max-stored-bytes: every upload's bytes together
        # Held by a delete, and by a job's creation from finding its file to storing the job:
        # a file is never deleted under a job that was just accepted.
        self.lock = threading.Lock()
        self._sweep()

    def _sweep(self) -> None:
        """Removes what a crash mid-upload left: temporary uploads, and data whose object was
        never written (such a file was never listed, so no client or job knows its id)."""
        if not self.dir.is_dir():
            return
        for tmp in self.dir.glob(".file-*.upload"):
            tmp.unlink(missing_ok=True)
        for data in self.dir.glob("file-*.jsonl"):
            if _FILE_ID.fullmatch(data.stem) and not self._object_path(data.stem).exists():
                data.unlink(missing_ok=True)

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
        if self.artifacts is not None:  # a job on another replica reads it from there
            self.artifacts.publish(dataset_path(file_id))
        return self._keep(file_id, size, filename, purpose)

    def _keep(self, file_id: str, size: int, filename: str, purpose: str) -> dict[str, Any]:
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "status_details": None}
        write_bytes_atomic(self._object_path(file_id), json.dumps(obj).encode())
        return obj

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
        """The bytes of every kept upload (their file objects say how many)."""
        return sum(int(obj.get("bytes", 0)) for obj in self.list())

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
        path = self._object_path(file_id) if _FILE_ID.fullmatch(file_id) else None
        try:
            if path is not None:
                return dict(json.loads(path.read_text()))
        except FileNotFoundError:
            pass
        raise NotFound(f"no file {echo(file_id)} (the files endpoint lists them)", param)

    def content(self, file_id: str) -> Path:
        self.get(file_id)
        return self.data_dir / dataset_path(file_id)

    def list(self, purpose: str | None = None) -> list[dict[str, Any]]:
        """Every file object, newest first."""
        objs = []
        for path in self.dir.glob("file-*.json") if self.dir.is_dir() else ():
            try:
                obj = json.loads(path.read_text())
            except FileNotFoundError:  # deleted meanwhile
                continue
            if purpose is None or obj["purpose"] == purpose:
                objs.append(obj)
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def delete(self, file_id: str) -> dict[str, Any]:
        with self.lock:
            self.get(file_id)
            users = self.jobs.using_dataset(dataset_path(file_id))
            if users:
                raise FailedPrecondition(f"job {users[0].id} ({users[0].state}) will read this file; cancel it or "
                                         "wait until it ends", "file_id")
            self._object_path(file_id).unlink(missing_ok=True)  # unlisted first: no half-deleted file is shown
            (self.data_dir / dataset_path(file_id)).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def _object_path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.json"


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
