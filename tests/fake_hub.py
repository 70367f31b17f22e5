"""A fake Hugging Face Hub on loopback, for tests without internet.

It answers what huggingface_hub calls for a model: GET /api/models/{repo}[/revision/{rev}]
(repo info with the commit sha and the file list), HEAD and GET /{repo}/resolve/{rev}/{file}
(with X-Repo-Commit, ETag and Content-Length; GET honours Range with 206), and the error codes
huggingface_hub maps to its exceptions (X-Error-Code: RepoNotFound, RevisionNotFound,
EntryNotFound, GatedRepo). It counts every request, can drop a connection in the middle of a
file once, fail a file's downloads (410) or send them slowly, and samples how many shard blobs are in a cache
directory whenever a shard download starts (the peak number of raw shards on disk).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


Content = bytes | Path  # a file's bytes, or a local file served from disk (benchmark-sized models)
SEND_CHUNK = 8 << 20


def size_of(c: Content) -> int:
    return len(c) if isinstance(c, bytes) else c.stat().st_size


@functools.lru_cache(maxsize=None)
def digest(c: Content) -> str:
    """The content's sha256 (its ETag and LFS sha256); for a file on disk, a stand-in derived from
    its path and size, so that serving a 5 GB shard does not mean hashing it first."""
    if isinstance(c, bytes):
        return hashlib.sha256(c).hexdigest()
    return hashlib.sha256(f"{c}:{size_of(c)}".encode()).hexdigest()


def chunks(c: Content, lo: int, hi: int) -> Iterator[bytes]:
    """Bytes [lo, hi) of the content, a bounded piece at a time."""
    if isinstance(c, bytes):
        yield c[lo:hi]
        return
    with open(c, "rb") as f:
        f.seek(lo)
        while lo < hi:
            block = f.read(min(SEND_CHUNK, hi - lo))
            if not block:
                return
            lo += len(block)
            yield block


@dataclass
class FakeRepo:
    revisions: dict[str, str]  # branch or tag -> commit sha
    files: dict[str, dict[str, Content]]  # commit sha -> {path in repo: content}
    gated: bool = False  # needs a token; 401 without one, 403 with the wrong one
    token: str = "hf_good"


def load_dir(path: Path, extra: dict[str, bytes] | None = None, on_disk: bool = False) -> dict[str, Content]:
    """Every file under `path` keyed by its relative path (its bytes, or with `on_disk` the file
    itself, served from disk), plus `extra`."""
    out: dict[str, Content] = {str(p.relative_to(path)): p if on_disk else p.read_bytes()
                               for p in sorted(path.rglob("*")) if p.is_file()}
    out.update(extra or {})
    return out


def commit_of(files: dict[str, Content]) -> str:
    h = hashlib.sha1()
    for name, data in sorted(files.items()):
        h.update(name.encode() + digest(data).encode())
    return h.hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)  # "METHOD path" -> count
    ranges: list[str] = field(default_factory=list)  # "path Range" of every ranged GET
    full_gets: Counter[str] = field(default_factory=Counter)  # path -> whole-file GETs
    drop_once: set[str] = field(default_factory=set)  # files whose next full GET dies half-way
    failing: set[str] = field(default_factory=set)  # files answered 410 (but for header Range reads)
    chunk_delay: float = 0.0  # seconds slept after every 4 KiB of a whole-file GET (a slow link)
    watch_cache: Path | None = None  # repo cache dir whose shard blobs are counted
    peak_shards: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, repo_id: str, files: dict[str, Content], gated: bool = False,
            **more_revisions: dict[str, Content]) -> str:
        """Serves `files` as the repo's main branch (other branches by keyword); returns main's sha."""
        repo = FakeRepo({}, {}, gated)
        for rev, content in {"main": files, **more_revisions}.items():
            sha = commit_of(content)
            repo.revisions[rev] = sha
            repo.files[sha] = content
        self.repos[repo_id] = repo
        return repo.revisions["main"]

    def count(self, suffix: str) -> int:
        """Requests (any method) whose path ends with `suffix`."""
        return sum(n for k, n in self.requests.items() if k.endswith(suffix))

    def fetched(self) -> set[str]:
        """Paths of files downloaded with a whole-file GET (not Range reads)."""
        return set(self.full_gets)

    def start(self) -> tuple[ThreadingHTTPServer, str]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, head=False)

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    # --- request handling --------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        with self._lock:
            self.requests[f"{h.command} {path}"] += 1
        if path.startswith("/api/models/"):
            self._info(h, path[len("/api/models/") :])
        elif "/resolve/" in path:
            self._resolve(h, path, head)
        else:
            self._error(h, 404, "RepoNotFound")

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401, "RepoNotFound")  # what the Hub says for missing (or private) repos
            return None
        if repo.gated:
            auth = h.headers.get("Authorization", "")
            if auth != f"Bearer {repo.token}":
                self._error(h, 403 if auth else 401, "GatedRepo", "Access to model is restricted.")
                return None
        return repo

    def _commit(self, h: BaseHTTPRequestHandler, repo: FakeRepo, rev: str) -> str | None:
        sha = repo.revisions.get(rev, rev if rev in repo.files else None)
        if sha is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha

    def _info(self, h: BaseHTTPRequestHandler, rest: str) -> None:
        repo_id, _, rev = rest.partition("/revision/")
        repo = self._repo(h, repo_id)
        if repo is None:
            return
        sha = self._commit(h, repo, rev or "main")
        if sha is None:
            return
        files = repo.files[sha]
        body = json.dumps({
            "id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "gated": repo.gated,
            "siblings": [{"rfilename": n, "size": size_of(d), **self._lfs(n, d)} for n, d in sorted(files.items())],
        }).encode()
        self._send(h, 200, body, {"Content-Type": "application/json"}, head=False)

    @staticmethod
    def _lfs(name: str, data: Content) -> dict[str, object]:
        """Weights are LFS files on the Hub: the listing carries their sha256."""
        if not name.endswith((".safetensors", ".bin", ".pth")):
            return {}
        return {"lfs": {"size": size_of(data), "sha256": digest(data), "pointerSize": 134}}

    def _resolve(self, h: BaseHTTPRequestHandler, path: str, head: bool) -> None:
        repo_id, _, rest = path.lstrip("/").partition("/resolve/")
        rev, _, filename = rest.partition("/")
        repo = self._repo(h, repo_id)
        if repo is None:
            return
        sha = self._commit(h, repo, rev)
        if sha is None:
            return
        data = repo.files[sha].get(filename)
        if data is None:
            self._error(h, 404, "EntryNotFound", f"{filename} does not exist", {"X-Repo-Commit": sha})
            return
        headers = {"X-Repo-Commit": sha, "ETag": f'"{digest(data)}"',
                   "Accept-Ranges": "bytes"}
        rng = h.headers.get("Range")
        if filename in self.failing and (head or rng is None):
            self._error(h, 410, "Gone", "temporarily withdrawn")
            return
        if head or rng is None:
            if not head:
                with self._lock:
                    self.full_gets[path] += 1
            if not head and filename.endswith(".safetensors"):
                self._sample_cache(data)
            if not head and filename in self.drop_once:
                self.drop_once.discard(filename)
                self._send_truncated(h, data, headers)
                return
            if not head and self.chunk_delay:
                self._send_slowly(h, data, headers)
                return
            self._send(h, 200, data, headers, head)
            return
        with self._lock:
            self.ranges.append(f"{path} {rng}")
        lo_s, _, hi_s = rng.removeprefix("bytes=").partition("-")
        lo = int(lo_s)
        size = size_of(data)
        hi = min(int(hi_s) if hi_s else size - 1, size - 1)
        headers["Content-Range"] = f"bytes {lo}-{hi}/{size}"
        self._send(h, 206, data, headers, head, lo, hi + 1)

    def _sample_cache(self, data: Content) -> None:
        """Shard blobs in the watched cache now, plus the one this GET is about to deliver."""
        if self.watch_cache is None:
            return
        blobs = self.watch_cache / "blobs"
        names = {p.name.split(".")[0] for p in blobs.iterdir()} if blobs.is_dir() else set()
        shard_etags = {digest(d) for r in self.repos.values() for fs in r.files.values()
                       for n, d in fs.items() if n.endswith(".safetensors")}
        present = len(names & shard_etags - {digest(data)}) + 1
        with self._lock:
            self.peak_shards = max(self.peak_shards, present)

    @staticmethod
    def _start(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], length: int) -> None:
        """The status line and headers of a response whose body has `length` bytes."""
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(length))
        h.end_headers()

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: Content, headers: dict[str, str], head: bool,
              lo: int = 0, hi: int | None = None) -> None:
        """Bytes [lo, hi) of `body` (default: all of it)."""
        hi = size_of(body) if hi is None else hi
        self._start(h, status, headers, hi - lo)
        if not head:
            for block in chunks(body, lo, hi):
                h.wfile.write(block)

    def _send_slowly(self, h: BaseHTTPRequestHandler, data: Content, headers: dict[str, str]) -> None:
        size = size_of(data)
        self._start(h, 200, headers, size)
        try:
            for lo in range(0, size, 4096):
                for block in chunks(data, lo, min(lo + 4096, size)):
                    h.wfile.write(block)
                h.wfile.flush()
                time.sleep(self.chunk_delay)
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True  # the client gave up, as it may

    def _send_truncated(self, h: BaseHTTPRequestHandler, data: Content, headers: dict[str, str]) -> None:
        """Promises the whole file, sends half, and closes the connection."""
        size = size_of(data)
        self._start(h, 200, headers, size)
        for block in chunks(data, 0, size // 2):
            h.wfile.write(block)
        h.wfile.flush()
        h.close_connection = True
        h.connection.close()

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str = "",
               extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message or code}).encode()
        headers = {"X-Error-Code": code, "Content-Type": "application/json", **(extra or {})}
        if message:
            headers["X-Error-Message"] = message
        self._send(h, status, body, headers, head=h.command == "HEAD")
