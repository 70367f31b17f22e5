"""An output file written on the caller's thread and hashed (sha256) on its own thread.

Two kinds of data go in: buffers (gathered columns, converted dtypes, padding) are written with
os.write; byte ranges of a source file are copied inside the kernel with copy_file_range, the
way `cp` does, so unchanged bytes never pass through Python. The hashing thread reads those
same ranges through short-lived mappings of the source (at most one chunk mapped at a time). Copying and hashing thus run on
the two cores in parallel, and page-cache pages are never mapped into this process.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
from pathlib import Path

import numpy as np

from convert.sources import pread_exact
from tprt.errors import CheckpointError, OutputError

HASH_READ_BYTES = 4 << 20  # the hashing thread's read buffer
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}
_copy_file_range_ok = hasattr(os, "copy_file_range")

_Range = tuple[int, int, int]  # (source fd, offset, nbytes)


class FileSink:
    def __init__(self, path: Path, header: bytes, size: int, max_queued: int = 6, resume_at: int = 0) -> None:
        """A new file starting with `header`; with `resume_at` > 0, the existing file's first
        `resume_at` bytes are kept (and hashed again) and writing continues after them."""
        self.path = path
        self.size = size  # what the header promises
        self.written = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if resume_at else os.O_TRUNC), 0o666)
        self._sha = hashlib.sha256()
        self._queue: queue.Queue[memoryview | _Range | None] = queue.Queue(maxsize=max_queued)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hash_loop, name=f"sha256:{path.name}", daemon=True)
        self._thread.start()
        if resume_at:
            self._keep_prefix(resume_at)
        else:
            self.write(header)

    def _keep_prefix(self, nbytes: int) -> None:
        os.ftruncate(self._fd, nbytes)  # drops whatever an interrupted run wrote after it
        os.lseek(self._fd, nbytes, os.SEEK_SET)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._hash_read(fd, 0, nbytes, memoryview(bytearray(HASH_READ_BYTES)))
        finally:
            os.close(fd)
        self.written = nbytes

    def sync(self) -> None:
        """Makes everything written so far durable."""
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise self._output_error(e) from e

    def write(self, buf: bytes | np.ndarray) -> None:
        """Writes `buf` (contiguous); it is kept by reference until hashed, so do not modify it."""
        mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
        self._check()
        self._write_all(mv)
        self.written += len(mv)
        self._queue.put(mv)

    def copy_from(self, fd: int, offset: int, nbytes: int, src: Path | str) -> None:
        """Appends bytes [offset, offset + nbytes) of the open file `fd` (named `src` in errors)."""
        global _copy_file_range_ok
        self._check()
        pos, left = offset, nbytes
        while left:
            if _copy_file_range_ok:
                try:
                    n = self._os_copy(fd, left, pos)
                except OSError as e:
                    if e.errno not in _NO_COPY_FILE_RANGE:
                        raise self._output_error(e) from e
                    _copy_file_range_ok = False  # e.g. another filesystem on an old kernel
                    continue
                if n == 0:
                    raise CheckpointError(f"{src}: truncated (unexpected end of file at byte {pos})")
            else:
                n = self._copy_buffered(fd, left, pos, src)
            pos, left = pos + n, left - n
        self.written += nbytes
        self._queue.put((fd, offset, nbytes))

    def _write_all(self, mv: memoryview) -> None:
        try:
            while mv:
                mv = mv[self._os_write(mv) :]
        except OSError as e:
            raise self._output_error(e) from e

    def _os_write(self, mv: memoryview) -> int:
        return os.write(self._fd, mv)

    def _os_copy(self, fd: int, count: int, pos: int) -> int:
        return os.copy_file_range(fd, self._fd, count, pos)

    def _copy_buffered(self, fd: int, count: int, pos: int, src: Path | str) -> int:
        buf = memoryview(bytearray(min(count, HASH_READ_BYTES)))
        pread_exact(fd, buf, pos, src)
        self._write_all(buf)
        return len(buf)

    def _output_error(self, e: OSError) -> OutputError:
        return OutputError(f"{self.path}: write failed: {e.strerror or e}")

    def _hash_loop(self) -> None:
        buf: memoryview | None = None
        while (item := self._queue.get()) is not None:
            try:
                if self._error is not None:
                    continue  # drain, so the writer never blocks on a dead queue
                if isinstance(item, memoryview):
                    self._sha.update(item)
                    continue
                if not self._hash_mapped(*item):
                    buf = buf or memoryview(bytearray(HASH_READ_BYTES))
                    self._hash_read(*item, buf)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                self._error = e
            finally:
                self._queue.task_done()

    def _hash_mapped(self, fd: int, pos: int, nbytes: int) -> bool:
        """Hashes a source range through a temporary mapping (no copy); the mapping is dropped at
        once, so its page-cache pages leave our RSS with it. False if the file cannot be mapped."""
        base = pos - pos % mmap.ALLOCATIONGRANULARITY
        try:
            m = mmap.mmap(fd, nbytes + pos - base, access=mmap.ACCESS_READ, offset=base)
        except (OSError, ValueError):
            return False
        try:
            with memoryview(m) as view:
                self._sha.update(view[pos - base :])
        finally:
            m.close()
        return True

    def _hash_read(self, fd: int, pos: int, left: int, buf: memoryview) -> None:
        while left:
            n = min(left, len(buf))
            pread_exact(fd, buf[:n], pos, f"fd {fd}")
            self._sha.update(buf[:n])
            pos, left = pos + n, left - n

    def drain(self) -> None:
        """Waits until everything written so far is hashed, so the source files it came from may
        be closed (the hashing thread reads copied ranges back from them)."""
        self._queue.join()
        self._check()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> tuple[int, str]:
        """Waits for the hash, fsyncs; returns (size, sha256)."""
        self._queue.put(None)
        self._thread.join()
        try:
            self._check()
            if self.written != self.size:
                raise CheckpointError(f"{self.path}: wrote {self.written} bytes, header promises {self.size}")
            os.fsync(self._fd)
        except OSError as e:
            raise self._output_error(e) from e
        finally:
            os.close(self._fd)
            self._fd = -1
        return self.size, self._sha.hexdigest()

    def abort(self) -> None:
        self._error = self._error or RuntimeError("aborted")
        self._queue.put(None)
        self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
