"""Atomic outputs: write under a temporary sibling name, fsync, rename; never a half-written DST."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tprt.errors import TprtError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output_dir(dst: Path, force: bool = False, flag: str = "DST", keep: str | None = None) -> Iterator[Path]:
    """Yields an empty temporary sibling of `dst`; on success it replaces `dst` (fsynced), on any
    error it is deleted and `dst` is untouched. An existing `dst` is refused unless `force`.
    With `keep`, the sibling is `.{dst.name}.{keep}`, reused if a failed run left it, and kept
    on error, so that a resumable writer can pick up where it stopped."""
    dst = Path(dst)
    if dst.exists() and not force:
        raise TprtError(f"{dst}: {flag} already exists; choose another path or pass --force to replace it")
    parent = dst.parent if str(dst.parent) else Path(".")
    if not parent.is_dir():
        raise TprtError(f"{parent}: parent directory of {flag} does not exist")
    if keep is not None:
        tmp = parent / f".{dst.name}.{keep}"
        tmp.mkdir(exist_ok=True)
    else:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; the result is an ordinary directory
        yield tmp
        for child in tmp.iterdir():  # files were fsynced by their writers; directories here
            if child.is_file():
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        if dst.exists():
            old = parent / f".{dst.name}.old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
        fsync_dir(parent)
    except BaseException:
        if keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
