"""Large CPU buffers on transparent huge pages.

Decoding streams every weight once per token. With the kernel's 4 KiB pages a 540 MB stream
misses the TLB every 4 KiB, and on this project's test machine one core then reads 20-23 GB/s;
the same sum over 2 MiB pages reads 31-34 GB/s (docs/PERF.md). Linux gives anonymous memory
huge pages only where asked (`transparent_hugepage=madvise`, the usual default), so the weights
(`tprt.checkpoint.loading`) and the KV cache (`tprt.model.kv_cache`) ask: one 2 MiB-aligned allocation, advised
with MADV_HUGEPAGE before its pages are first touched. Elsewhere (no Linux, THP disabled) the
advice is refused or ignored and the buffer is ordinary memory; nothing else changes.
"""

from __future__ import annotations

import ctypes
import math
import sys
from functools import cache

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes`, starting on a 2 MiB boundary and advised
    to use huge pages (small requests get ordinary memory: a huge page would mostly be waste)."""
    if nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # large: fresh, untouched pages
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start:start + nbytes]
    madvise = _madvise()
    if madvise is not None:
        madvise(buf.data_ptr(), nbytes, _MADV_HUGEPAGE)  # advice: a refusal (EINVAL: THP off) is harmless
    return buf


def huge_tensors(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Uninitialised tensors of `shapes` carved from one `huge_empty` buffer (each 64-byte
    aligned), so that small tensors share huge pages too."""
    sizes = [dtype.itemsize * math.prod(shape) for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // 64) * 64
    buf = huge_empty(total)
    return [buf[o:o + s].view(dtype).view(shape) for o, s, shape in zip(offsets, sizes, shapes)]
