"""Low-level safetensors: a validating header reader, zero-copy mmapped views, a streaming writer.

The format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes. We parse it ourselves so that a corrupt file gets an
error naming the file and the tensor, and so the converter can copy raw byte ranges without
ever materialising a tensor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import os
import queue
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from tprt.errors import CheckpointError, OutputError

if TYPE_CHECKING:
    import torch

# safetensors dtype name -> bytes per element. torch is imported only when a torch dtype is asked
# for (DTYPES, TORCH_TO_ST, SafetensorsFile.tensor), so byte-level tools such as the converter
# start without paying torch's import time.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1,
}
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
}
# numpy has no bfloat16: raw bytes are viewed through an unsigned type of the same width.
_RAW_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

if TYPE_CHECKING:
    # safetensors dtype name -> (torch dtype, bytes per element); built on first use
    DTYPES: dict[str, tuple[torch.dtype, int]]
    TORCH_TO_ST: dict[torch.dtype, str]


@functools.cache
def _torch_tables() -> tuple[dict[str, tuple[torch.dtype, int]], dict[torch.dtype, str]]:
    import torch

    dtypes = {k: (getattr(torch, v), DTYPE_SIZES[k]) for k, v in _TORCH_NAMES.items()}
    return dtypes, {t: name for name, (t, _) in dtypes.items()}


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        return _torch_tables()[0]
    if name == "TORCH_TO_ST":
        return _torch_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_HEADER_BYTES = 100 * 1024 * 1024


def st_dtype(dtype: torch.dtype) -> str:
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors") from None


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives inside a safetensors file."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_tables()[0][self.dtype][0]


def read_header(path: Path, shown: str | None = None) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parses and validates the header: every offset inside the file and consistent with its shape.
    Errors name the file as `shown` (default: its path)."""
    name = str(path) if shown is None else shown
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{name}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{name}: corrupt safetensors header (declares {n} header bytes, file has {size})"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{name}: file not found") from None
    except OSError as e:  # a directory, no permission, ...
        raise CheckpointError(f"{name}: cannot be read ({e.strerror or type(e).__name__})") from None
    return parse_header(raw, size, name)


def _count(value: Any) -> int | None:
    """`value` as a JSON count (a non-negative integer, not a bool or a float), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_header(raw: bytes, size: int, path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The JSON header `raw` (the bytes after the 8-byte length) of a safetensors file of `size`
    bytes, validated as read_header does; `path` names the file in errors. Every tensor's dtype
    is known, its shape non-negative integers whose byte size is its span, and the spans lie in
    the data without overlapping: nothing downstream (mmap views, torch) sees a lying header."""
    n = len(raw)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ is not a JSON object)")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            dims = tuple(_count(s) for s in shape)
            b, e = (_count(o) for o in offsets)
        except (KeyError, TypeError, ValueError):  # not a dict, missing keys, not lists, not two offsets
            raise CheckpointError(f"{path}: tensor {echo_short(name)} has a malformed header entry") from None
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor {echo_short(name)} has unsupported dtype {echo_short(dtype)}")
        shape = tuple(d for d in dims if d is not None)
        if len(shape) != len(dims):
            raise CheckpointError(f"{path}: tensor {echo_short(name)} has a shape that is not a list of non-negative integers")
        if b is None or e is None or b > e:
            raise CheckpointError(f"{path}: tensor {echo_short(name)} has data_offsets that are not two ordered byte offsets")
        expected = math.prod(shape) * DTYPE_SIZES[dtype]  # Python ints: an absurd shape cannot overflow
        if e - b != expected:
            raise CheckpointError(
                f"{path}: tensor {echo_short(name)} spans {e - b} bytes but shape {list(shape)} {dtype} needs {expected}"
            )
        if e > data_size:
            raise CheckpointError(
                f"{path}: truncated: tensor {echo_short(name)} ends at byte {data_start + e}, file has {size}"
            )
        tensors[name] = TensorInfo(name, dtype, shape, data_start + b, data_start + e)
    spans = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    for before, after in zip(spans, spans[1:]):
        if after.begin < before.end:
            raise CheckpointError(f"{path}: tensors {echo_short(before.name)} and {echo_short(after.name)} overlap in the file")
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def echo_short(value: Any, limit: int = 40) -> str:
    """A value from a file, shown in an error at most `limit` characters long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SafetensorsFile:
    """A read-only, memory-mapped safetensors file; views share memory with the page cache."""

    def __init__(self, path: str | Path, shown: str | None = None) -> None:
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path, shown)
        self._file = open(self.path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as an unsigned-integer array of its shape (zero-copy)."""
        t = self.info(name)
        assert self._mmap is not None
        arr = np.frombuffer(self._mmap, dtype=_RAW_NP[t.itemsize], count=t.nbytes // t.itemsize, offset=t.begin)
        return arr.reshape(t.shape)

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy torch view; copy it before the file is closed if it must outlive it."""
        import torch

        t = self.info(name)
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=t.torch_dtype)
        assert self._mmap is not None
        with warnings.catch_warnings():  # the mapping is read-only on purpose; torch warns about it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(self._mmap, dtype=t.torch_dtype, count=t.nbytes // t.itemsize, offset=t.begin)
        return flat.view(t.shape)

    def close(self) -> None:
        # Views handed out keep the mmap alive; closing only drops our references.
        self._mmap = None
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    """Header bytes (length prefix included) for tensors laid out back to back in `entries` order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw


class HashingWriter:
    """Writes a file on a background thread, hashing it (sha256) on the way, so that the caller's
    reading and gathering overlap the hashing and the write. hashlib and file writes release the
    GIL, so this uses the second core. Buffers are queued by reference: do not reuse them."""

    def __init__(self, path: Path, max_queued: int = 4) -> None:
        self.path = path
        self._file = open(path, "wb")
        self._sha = hashlib.sha256()
        self.bytes_written = 0
        self._queue: queue.Queue[memoryview | bytes | None] = queue.Queue(maxsize=max_queued)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"write:{path.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            buf = self._queue.get()
            if buf is None:
                return
            if self._error is not None:
                continue  # drain so the producer never blocks on a dead writer
            try:
                self._sha.update(buf)
                self._file.write(buf)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e

    def write(self, buf: bytes | memoryview | np.ndarray) -> None:
        if self._error is not None:
            self._raise()
        mv: bytes | memoryview = buf if isinstance(buf, bytes) else memoryview(buf).cast("B")  # type: ignore[arg-type]
        self.bytes_written += len(mv)
        self._queue.put(mv)

    def _raise(self) -> None:
        err = self._error
        assert err is not None
        if isinstance(err, OSError):
            raise OutputError(f"{self.path}: write failed: {err.strerror or err}") from err
        raise err

    def close(self) -> str:
        """Flushes and fsyncs; returns the sha256 hex digest."""
        self._queue.put(None)
        self._thread.join()
        if self._error is None:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as e:
                self._error = e
        self._file.close()
        if self._error is not None:
            self._raise()
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._error = self._error or RuntimeError("aborted")
        self._queue.put(None)
        self._thread.join()
        self._file.close()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()


class StreamingSafetensorsWriter:
    """Writes a safetensors file whose header is known up front and whose data arrives in order,
    chunk by chunk, so no tensor is ever held whole. `close()` checks every byte arrived."""

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        max_queued: int = 4,
    ) -> None:
        self.path = path
        self.entries = entries
        self._header = build_header(entries, metadata)
        self._expected = len(self._header) + sum(
            int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype] for _, dtype, shape in entries
        )
        self._writer = HashingWriter(path, max_queued=max_queued)
        self._writer.write(self._header)

    def write(self, buf: bytes | memoryview | np.ndarray) -> None:
        self._writer.write(buf)

    @property
    def bytes_written(self) -> int:
        return self._writer.bytes_written

    @property
    def size(self) -> int:
        """The file's final size in bytes, known from the header."""
        return self._expected

    def close(self) -> tuple[int, str]:
        """Returns (size, sha256)."""
        digest = self._writer.close()
        if self._writer.bytes_written != self._expected:
            raise CheckpointError(
                f"{self.path}: wrote {self._writer.bytes_written} bytes, header promises {self._expected}"
            )
        return self._expected, digest

    def abort(self) -> None:
        self._writer.abort()


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
