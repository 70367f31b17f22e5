"""The artifact store a fleet's replicas share (`tprt serve --artifacts URL`): job directories
(inline datasets, training checkpoints, trained adapters) and uploaded files, kept under one URL
through fsspec (a directory or file:// path; s3://, gs:// and the rest with fsspec's package for
them, e.g. s3fs). Each replica works on its own --data-dir and copies what it writes here, and what
another replica wrote from here, by the same relative name (`jobs/<id>`, `files/<id>.jsonl`).

Publishing is atomic where object stores have no rename: an artifact's files go under a new
version prefix (`<name>@<version>/...`), then its manifest (`<name>.manifest.json`: the version,
and each file's size and SHA-256) is written in one request, to a temporary name and moved into
place where the filesystem can rename. Readers see an artifact only through its manifest, so a
publish cut short is never read; the previous version's files are removed after the manifest
moves on. A fetch writes into a temporary directory, checks every file's size and checksum, then
renames it into place in the data dir, and keeps the manifest beside it, so an unchanged artifact
is not fetched again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from serve.errors import Unavailable

log = logging.getLogger("tprt.serve")

_CHUNK = 1 << 20


class ArtifactError(Unavailable):
    """An artifact that cannot be read back as it was written (a checksum or size differs, a
    file is missing), or a store that cannot be reached."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Artifacts:
    """See the module docstring. `data_dir` is this replica's working copy."""

    def __init__(self, url: str, data_dir: Path) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.data_dir = Path(data_dir)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)

    def _remote(self, name: str) -> str:
        return f"{self.root}/{name}"

    def manifest(self, name: str) -> dict[str, Any] | None:
        """The published manifest of `name`, or None when nothing is published under it."""
        path = self._remote(f"{name}.manifest.json")
        try:
            with self.fs.open(path, "rb") as f:
                return dict(json.loads(f.read()))
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self.manifest(name) is not None

    def publish(self, name: str) -> dict[str, Any]:
        """Copies `data_dir/name` (a file or a directory) to the store as its new version;
        returns the manifest."""
        local = self.data_dir / name
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        version = f"{time.time_ns()}-{secrets.token_hex(4)}"
        prefix = self._remote(f"{name}@{version}")
        entries: dict[str, dict[str, Any]] = {}
        for path in files:
            rel = path.relative_to(local).as_posix() if local.is_dir() else path.name
            entries[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
            target = f"{prefix}/{rel}"
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), target)
        manifest = {"name": name, "version": version, "dir": local.is_dir(), "files": entries}
        old = self.manifest(name)
        tmp = self._remote(f"{name}.manifest.json.tmp-{secrets.token_hex(4)}")
        with self.fs.open(tmp, "wb") as f:
            f.write(json.dumps(manifest, sort_keys=True).encode())
        self.fs.mv(tmp, self._remote(f"{name}.manifest.json"))
        if old is not None and old["version"] != version:
            self.fs.rm(self._remote(f"{name}@{old['version']}"), recursive=True)
        self._remember(name, manifest)
        return manifest

    def remove(self, name: str) -> None:
        """Unpublishes `name`: its manifest first (readers stop seeing it), then its files."""
        old = self.manifest(name)
        if old is None:
            return
        self.fs.rm(self._remote(f"{name}.manifest.json"))
        try:
            self.fs.rm(self._remote(f"{name}@{old['version']}"), recursive=True)
        except FileNotFoundError:  # removed meanwhile by another replica
            pass
        self._marker(name).unlink(missing_ok=True)

    def fetch(self, name: str) -> bool:
        """Brings the published `name` into `data_dir/name` unless the copy there is that version
        already; False when nothing is published under it. ArtifactError when a file does not
        read back as published (nothing in the data dir changes then)."""
        manifest = self.manifest(name)
        if manifest is None:
            return False
        local = self.data_dir / name
        if self._remembered(name) == manifest["version"] and local.exists():
            return True
        prefix = self._remote(f"{name}@{manifest['version']}")
        staging = local.parent / f".{local.name}.fetch-{secrets.token_hex(4)}"
        staging.mkdir(parents=True)
        try:
            for rel, facts in manifest["files"].items():
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self.fs.get_file(f"{prefix}/{rel}", str(target))
                except FileNotFoundError:
                    raise ArtifactError(f"artifact {name}: {rel} is missing from the store") from None
                if target.stat().st_size != facts["size"] or _sha256(target) != facts["sha256"]:
                    raise ArtifactError(f"artifact {name}: {rel} does not match its checksum; it was changed or "
                                        "cut short in the store")
            source = staging if manifest["dir"] else staging / next(iter(manifest["files"]))
            _replace(source, local)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._remember(name, manifest)
        return True

    def _marker(self, name: str) -> Path:
        local = self.data_dir / name
        return local.parent / f".{local.name}.artifact-version"

    def _remember(self, name: str, manifest: dict[str, Any]) -> None:
        self._marker(name).write_text(manifest["version"])

    def _remembered(self, name: str) -> str | None:
        try:
            return self._marker(name).read_text()
        except FileNotFoundError:
            return None


def _replace(source: Path, local: Path) -> None:
    """Puts `source` where `local` is, replacing it (a directory is swapped by two renames)."""
    local.parent.mkdir(parents=True, exist_ok=True)
    if local.is_dir() and not local.is_symlink():
        old = local.parent / f".{local.name}.old-{secrets.token_hex(4)}"
        os.rename(local, old)
        os.rename(source, local)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(source, local)
