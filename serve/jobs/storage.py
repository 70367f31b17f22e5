"""Room on the disk under --data-dir: refuse a write that would not fit before starting it.

Uploads and jobs check here first (`ensure_room`): the bytes they will write plus a reserve
(RESERVE_BYTES: room for the job store's own writes, checkpoints and adapters) must be free, and
the uploaded files together stay within --max-stored-bytes (`ensure_quota`). A write that fails
anyway (another process filled the disk meanwhile) raises OSError ENOSPC, which serve.errors maps
to the same RESOURCE_EXHAUSTED / HTTP 507.
"""

from __future__ import annotations

import os
from pathlib import Path

from serve.errors import InsufficientStorage

RESERVE_BYTES = 64 << 20


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ensure_room(path: Path, need: int, reserve: int = RESERVE_BYTES) -> None:
    """InsufficientStorage unless `need` bytes and the reserve are free under `path`."""
    free = free_bytes(path)
    if free < need + reserve:
        raise InsufficientStorage(f"the server's storage (--data-dir) has {free} bytes free; this needs {need} "
                                  f"and {reserve} are kept in reserve")


def ensure_quota(used: int, need: int, limit: int | None, flag: str) -> None:
    """InsufficientStorage when `used + need` bytes would pass `limit` (the flag that sets it)."""
    if limit is not None and used + need > limit:
        raise InsufficientStorage(f"{used} bytes are stored and this needs {need}: over the {limit} of {flag}; "
                                  "delete some first")
