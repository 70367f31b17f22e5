"""The streaming copy: one pass over the source, tensor by tensor in bounded row chunks, each
chunk fanned out to the output files that hold a piece of it.

Every output file has its own writer thread (hash + write, see HashingWriter), so reading and
gathering on this thread overlap hashing and writing. Chunks are read with positioned reads into
fresh buffers rather than through a mapping, so page-cache pages never count towards our RSS; a
buffer is freed once every writer it was queued to has written it. Memory is therefore bounded by
CHUNK_BYTES times the writers' queue depth, whatever the model's size.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from convert.plan import Piece, Plan, TensorPlan
from convert.progress import Progress
from convert.sources import RawSource, TensorSource
from tprt.errors import CheckpointError, OutputError
from tprt.safetensors_io import DTYPES, StreamingSafetensorsWriter

CHUNK_BYTES = 16 << 20  # source bytes read per step
QUEUE_DEPTH = 3  # chunks queued per writer thread


def execute(plan: Plan, source: TensorSource, outdir: Path, progress: Progress, dst: Path) -> dict[str, tuple[int, str]]:
    """Writes every file of `plan` under `outdir`; returns file name -> (size, sha256).
    `dst` is only used to name the output in error messages."""
    remaining = Counter(p.file for t in plan.tensors for p in t.pieces)
    writers: dict[int, StreamingSafetensorsWriter] = {}
    done: dict[str, tuple[int, str]] = {}
    try:
        for t in plan.tensors:
            for p in t.pieces:
                if p.file not in writers:
                    f = plan.files[p.file]
                    writers[p.file] = StreamingSafetensorsWriter(outdir / f.name, f.entries, f.metadata, QUEUE_DEPTH)
                    progress.update(writers[p.file].bytes_written)
            copy_tensor(t, source, writers, progress)
            for p in t.pieces:
                remaining[p.file] -= 1
                if remaining[p.file] == 0:
                    done[plan.files[p.file].name] = writers.pop(p.file).close()
    except OutputError as e:
        _abort(writers)
        cause = e.__cause__
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(e)
        raise OutputError(f"{dst}: writing the output failed: {why}") from e
    except BaseException:
        _abort(writers)
        raise
    return done


def _abort(writers: dict[int, StreamingSafetensorsWriter]) -> None:
    for w in writers.values():
        w.abort()
    writers.clear()


def copy_tensor(t: TensorPlan, source: TensorSource, writers: dict[int, StreamingSafetensorsWriter], progress: Progress) -> None:
    """Streams tensor `t` to its pieces' writers, CHUNK_BYTES of source at a time."""
    rows = t.shape[0]
    step = max(1, CHUNK_BYTES // max(t.row_bytes, t.src_row_bytes, 1))
    col = t.row_bytes // t.shape[1] if len(t.shape) > 1 else 0  # bytes per index along dim 1
    raw = t.src_dtype == t.out_dtype and isinstance(source, RawSource)
    zeros: np.ndarray | None = None
    a = 0
    while a < rows:
        if a < t.real_rows:
            b = min(a + step, t.real_rows)
            block = _read(source, t, a, b, raw)
        else:  # vocabulary padding: zero rows, one shared read-only buffer
            b = min(a + step, rows)
            if zeros is None:
                zeros = np.zeros((min(step, rows - a), t.row_bytes), dtype=np.uint8)
            block = zeros[: b - a]
        for p in t.pieces:
            part = _part(block, p, a, b, col)
            if part is not None and part.size:
                writers[p.file].write(part)
                progress.update(part.nbytes)
        a = b


def _part(block: np.ndarray, p: Piece, a: int, b: int, col: int) -> np.ndarray | None:
    """The bytes of rows [a, b) (held in `block`) that piece `p` receives, as a contiguous array."""
    if p.split_dim is None:
        return block
    if p.split_dim == 0:
        lo, hi = max(a, p.lo), min(b, p.hi)
        return block[lo - a : hi - a] if lo < hi else None
    return np.ascontiguousarray(block[:, p.lo * col : p.hi * col])


def _read(source: TensorSource, t: TensorPlan, a: int, b: int, raw: bool) -> np.ndarray:
    """Rows [a, b) of `t` in the output dtype, as uint8 [rows, row bytes]."""
    if raw:
        block = source.raw_rows(t.name, a, b)  # type: ignore[attr-defined]
        if block.shape != (b - a, t.row_bytes):
            raise CheckpointError(f"{source.path}: tensor {t.name!r}: rows {a}:{b} read back as {block.shape} bytes")
        return block
    x = source.read_rows(t.name, a, b)
    want = (b - a, *t.shape[1:])
    if tuple(x.shape) != want:
        raise CheckpointError(
            f"{source.path}: tensor {t.name!r}: rows {a}:{b} read back with shape {list(x.shape)}, expected {list(want)}"
        )
    out = DTYPES[t.out_dtype][0]
    if x.dtype != out:
        x = x.to(out)
    return x.contiguous().reshape(-1).view(torch.uint8).numpy().reshape(b - a, t.row_bytes)
