"""Peak resident memory of a phase of this process, for checking tprt's memory planner (tprt.plan).

CPU tensors come from glibc's malloc, which keeps freed memory for reuse, so a process's RSS is
its live bytes only when freed memory goes back to the kernel. `MemoryProbe` arranges that:
allocations of 64 KiB and more are mmapped (a fixed M_MMAP_THRESHOLD, which also turns off
glibc's raising of the threshold after frees) and unmapped when freed, and the heap is trimmed
before the baseline is read. The peak is the kernel's RSS high-water mark (VmHWM), reset through
/proc/self/clear_refs when `restart_peak()` is called: after loading a checkpoint, so that the
rank file's mmapped pages (gone once the weights are copied out) are not counted.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

_M_MMAP_THRESHOLD = -3  # <malloc.h>
_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class MemoryProbe:
    """Bytes resident above a baseline: `peak()` since the last `restart_peak()`, `now()`."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallopt(_M_MMAP_THRESHOLD, 64 << 10)
        self.base = self._settled_rss()
        self.restart_peak()

    def _settled_rss(self) -> int:
        gc.collect()
        self._libc.malloc_trim(0)
        return _status_kib("VmRSS") * 1024

    def restart_peak(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def peak(self) -> int:
        return _status_kib("VmHWM") * 1024 - self.base

    def now(self) -> int:
        return _status_kib("VmRSS") * 1024 - self.base
