"""The streaming copy: one pass over the source, tensor by tensor, each output file receiving its
piece of every tensor in header order.

Two paths, chosen per tensor:
- rows: the dtype is unchanged and every piece is a row range (dim-0 splits, replicated tensors,
  whole tensors for HF shards): the source's byte ranges are copied in the kernel
  (FileSink.copy_from), CHUNK_BYTES at a time, and never enter this process.
- chunks: dim-1 splits (o_proj, down_proj) or a dtype change: CHUNK_BYTES of rows are read with
  positioned reads into a fresh buffer (converted if needed), and each piece takes its columns.

Each output file hashes on its own thread (FileSink), so hashing overlaps the copy. Memory is
bounded by CHUNK_BYTES times the sinks' queue depth, whatever the size of the model or of its
largest tensor, and no page cache is ever mapped into the process.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from convert.plan import Piece, Plan, TensorPlan
from convert.progress import Progress
from convert.resume import Journal, ResumeState
from convert.sink import FileSink
from convert.sources import RawSource, ReleasingSource, TensorSource
from tprt.errors import CheckpointError, OutputError
from tprt.checkpoint.safetensors_io import build_header

CHUNK_BYTES = 16 << 20  # bytes handled per step


def execute(
    plan: Plan, source: TensorSource, outdir: Path, progress: Progress, dst: Path, journal: Journal | None = None,
) -> dict[str, tuple[int, str]]:
    """Writes every file of `plan` under `outdir`; returns file name -> (size, sha256).
    `dst` names the output in error messages. With a `journal`, a run it records as interrupted
    resumes after its last checkpoint, and each source release (the end of a shard) is one."""
    state = journal.prepare() if journal is not None else ResumeState()
    todo = plan.tensors[state.tensors_done :]
    remaining = Counter(p.file for t in todo for p in t.pieces)
    index = {f.name: k for k, f in enumerate(plan.files)}
    sinks: dict[int, FileSink] = {}
    done: dict[str, tuple[int, str]] = dict(state.closed)
    releases = source.release_after([t.name for t in todo]) if isinstance(source, ReleasingSource) else {}
    try:
        for name, nbytes in state.written.items():  # files an interrupted run left open
            f = plan.files[index[name]]
            sinks[index[name]] = FileSink(outdir / name, b"", f.size, resume_at=nbytes)
        progress.update(sum(s.written for s in sinks.values()) + sum(size for size, _ in done.values()))
        for i, t in enumerate(todo, start=state.tensors_done + 1):
            for p in t.pieces:
                if p.file not in sinks:
                    f = plan.files[p.file]
                    sinks[p.file] = FileSink(outdir / f.name, build_header(f.entries, f.metadata), f.size)
                    progress.update(sinks[p.file].written)
            copy_tensor(t, source, sinks, progress)
            for p in t.pieces:
                remaining[p.file] -= 1
                if remaining[p.file] == 0:
                    done[plan.files[p.file].name] = sinks.pop(p.file).close()
            if t.name in releases:
                for open_sink in sinks.values():
                    open_sink.drain()
                if journal is not None:
                    _checkpoint(journal, i, sinks, done)
                releases[t.name]()
    except OutputError as e:
        _abort(sinks)
        why = str(e).rsplit(": write failed: ", 1)[-1]
        raise OutputError(f"{dst}: writing the output failed: {why}") from e
    except BaseException:
        _abort(sinks)
        raise
    if journal is not None:
        journal.remove()
    return done


def _checkpoint(journal: Journal, tensors_done: int, sinks: dict[int, FileSink], done: dict[str, tuple[int, str]]) -> None:
    """Everything written so far made durable, then recorded."""
    for s in sinks.values():
        s.sync()
    journal.save(ResumeState(tensors_done, {s.path.name: s.written for s in sinks.values()}, dict(done)))


def _abort(sinks: dict[int, FileSink]) -> None:
    for s in sinks.values():
        s.abort()
    sinks.clear()


def copy_tensor(t: TensorPlan, source: TensorSource, sinks: dict[int, FileSink], progress: Progress) -> None:
    """Streams tensor `t` to the sinks of its pieces."""
    if _kernel_copyable(t, source):
        for p in t.pieces:
            _copy_rows(t, p, source, sinks[p.file], progress)
    else:
        _copy_chunks(t, source, sinks, progress)


def _kernel_copyable(t: TensorPlan, source: TensorSource) -> bool:
    if t.src_dtype != t.out_dtype or not isinstance(source, RawSource) or any(p.split_dim == 1 for p in t.pieces):
        return False
    return source.byte_ranges(t.name, 0, min(1, t.real_rows)) is not None


def _row_range(t: TensorPlan, p: Piece) -> tuple[int, int]:
    return (0, t.shape[0]) if p.split_dim is None else (p.lo, p.hi)


def _copy_rows(t: TensorPlan, p: Piece, source: TensorSource, sink: FileSink, progress: Progress) -> None:
    """Kernel-side copy of piece `p`'s rows, then its zero padding."""
    lo, hi = _row_range(t, p)
    real_hi = min(hi, t.real_rows)
    ranges = source.byte_ranges(t.name, lo, real_hi) if lo < real_hi else []  # type: ignore[attr-defined]
    if ranges is None:
        raise CheckpointError(f"{source.path}: tensor {t.name!r}: rows {lo}:{real_hi} are not stored contiguously")
    for fd, offset, nbytes in ranges:
        for start in range(offset, offset + nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, offset + nbytes - start)
            sink.copy_from(fd, start, n, source.path)
            progress.update(n)
    pad_lo = max(lo, t.real_rows)
    if pad_lo < hi:
        _write_zeros(sink, (hi - pad_lo) * t.row_bytes, progress)


def _write_zeros(sink: FileSink, nbytes: int, progress: Progress) -> None:
    zeros = np.zeros(min(nbytes, CHUNK_BYTES), dtype=np.uint8)  # read-only: safe to queue repeatedly
    while nbytes:
        n = min(nbytes, zeros.size)
        sink.write(zeros[:n])
        progress.update(n)
        nbytes -= n


def _copy_chunks(t: TensorPlan, source: TensorSource, sinks: dict[int, FileSink], progress: Progress) -> None:
    """Reads CHUNK_BYTES of rows at a time and hands each piece its part."""
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
                sinks[p.file].write(part)
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
    from tprt.checkpoint.safetensors_io import DTYPES

    x = source.read_rows(t.name, a, b)
    want = (b - a, *t.shape[1:])
    if tuple(x.shape) != want:
        raise CheckpointError(
            f"{source.path}: tensor {t.name!r}: rows {a}:{b} read back with shape {list(x.shape)}, expected {list(want)}"
        )
    out = DTYPES[t.out_dtype][0]
    if x.dtype != out:
        x = x.to(out)
    return x.contiguous().reshape(-1).view(DTYPES["U8"][0]).numpy().reshape(b - a, t.row_bytes)
