"""Where the converter reads weights from: one protocol, three kinds of source.

Every source presents the model under Hugging Face names in HF layout ([out, in]), with the
true (unpadded) vocabulary and without kv replication, whatever the storage looks like. The
engine only ever asks for row ranges, so no source has to materialise a whole tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from convert.rules import is_ignored
from tprt.parallel.sharding import VOCAB_TENSORS
from tprt.checkpoint.format import TOKENIZER_FILES, TPCheckpoint, is_tp_checkpoint
from tprt.model.config import ModelConfig
from tprt.errors import CheckpointError
from tprt.checkpoint.safetensors_io import DTYPE_SIZES, read_header

if TYPE_CHECKING:
    import torch  # imported where needed: byte-level conversions never load it


@runtime_checkable
class TensorSource(Protocol):
    """A model to convert, read row range by row range."""

    path: Path
    config: ModelConfig  # parsed
    config_json: dict[str, Any]  # written as DST/config.json (HF form)
    weight_map: dict[str, str] | None  # tensor name -> HF shard file name, if the source had shards

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF names -> HF global shapes ([out, in]; true vocabulary, no kv replication)."""
        ...

    def dtype(self, name: str) -> str:
        """safetensors dtype name of the stored (or dequantised) data: "F32", "BF16", ..."""
        ...

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0 (for 1-D tensors: elements), contiguous, HF layout."""
        ...

    def aux_files(self) -> dict[str, bytes]:
        """tokenizer.json, tokenizer_config.json, generation_config.json, ... to write into DST."""
        ...

    def close(self) -> None: ...


ByteRange = tuple[int, int, int]  # (open file descriptor, offset, nbytes)


@runtime_checkable
class RawSource(Protocol):
    """Optional fast paths for copies without a dtype change."""

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """The stored bytes of rows [start, stop): uint8 [stop - start, bytes per row], freshly
        allocated, so the caller may keep it."""
        ...

    def byte_ranges(self, name: str, start: int, stop: int) -> list[ByteRange] | None:
        """File ranges whose concatenation is the bytes of rows [start, stop), for kernel-side
        copies; None when those rows are not stored contiguously (then use raw_rows)."""
        ...


@runtime_checkable
class ReleasingSource(Protocol):
    """A source that frees what it read (a downloaded shard) once the tensors using it are written."""

    def release_after(self, names: list[str]) -> dict[str, Callable[[], None]]:
        """Tensor -> callback to run once that tensor (in `names` order) is written and hashed."""
        ...


def row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one dim-0 row (for 1-D tensors: one element)."""
    return int(np.prod(shape[1:], dtype=np.int64)) * itemsize


def pread_exact(fd: int, out: np.ndarray | memoryview, offset: int, path: Path | str) -> None:
    """Fills `out` (contiguous) from `offset` with positioned reads; no page cache is mapped, so
    nothing read this way counts towards the process's resident memory once `out` is freed."""
    mv = memoryview(out).cast("B") if isinstance(out, np.ndarray) else out  # type: ignore[arg-type]
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{path}: truncated (unexpected end of file at byte {offset + done})")
        done += n


class _PreadFile:
    """A safetensors file read by byte range: validated header, one descriptor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors, self.metadata = read_header(path)
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        info = self.tensors[name]
        out = np.empty((stop - start, row_bytes(info.shape, info.itemsize)), dtype=np.uint8)
        self.rows_into(name, start, out)
        return out

    def rows_into(self, name: str, start: int, out: np.ndarray) -> None:
        """Rows [start, start + len(out)) into the contiguous uint8 array `out`."""
        fd, offset, _ = self.span(name, start, start + len(out))
        pread_exact(fd, out, offset, self.path)

    def span(self, name: str, start: int, stop: int) -> ByteRange:
        info = self.tensors[name]
        rb = row_bytes(info.shape, info.itemsize)
        return self.fd, info.begin + start * rb, (stop - start) * rb

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def as_torch(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Reinterprets uint8 rows as a tensor of `dtype` with trailing dims `shape[1:]` (zero-copy)."""
    import torch

    from tprt.checkpoint.safetensors_io import DTYPES

    torch_dtype = DTYPES[dtype][0]
    if raw.size == 0:
        return torch.empty((raw.shape[0], *shape[1:]), dtype=torch_dtype)
    t = torch.from_numpy(raw.reshape(-1)).view(torch_dtype)
    return t.view(raw.shape[0], *shape[1:]) if len(shape) > 1 else t


def _aux_files(directory: Path) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in TOKENIZER_FILES if (directory / n).is_file()}


def _read_config(directory: Path) -> tuple[ModelConfig, dict[str, Any]]:
    cfg = ModelConfig.from_file(directory / "config.json")
    refuse_prequantized(cfg.raw, directory / "config.json")
    return cfg, dict(cfg.raw)


def refuse_prequantized(config: dict[str, Any], where: Path) -> None:
    """A pre-quantized HF checkpoint (config.json `quantization_config`: compressed-tensors FP8 as
    vLLM reads it, GPTQ, AWQ, bitsandbytes, ...) is refused by its format's name: its tensors are
    not a float Llama's. tprt quantizes float checkpoints itself (`--quantize int8|fp8`)."""
    qc = config.get("quantization_config")
    if qc is None:
        return
    method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "unknown"
    what = method
    if method == "compressed-tensors" and isinstance(qc, dict):
        groups = qc.get("config_groups") or {}
        kinds = {str(g.get("weights", {}).get("type", "?")) + str(g.get("weights", {}).get("num_bits", ""))
                 for g in groups.values() if isinstance(g, dict)}
        what = f"compressed-tensors ({', '.join(sorted(kinds)) or 'unknown scheme'})"
    raise CheckpointError(f"{where}: quantization_config says the weights are pre-quantized ({what}), which "
                          "tprt does not import; convert the float checkpoint with --quantize int8 or fp8 instead")


class HFSafetensorsSource:
    """An HF directory with model.safetensors or shards listed in model.safetensors.index.json."""

    def __init__(self, path: Path, files: list[str], weight_map: dict[str, str] | None) -> None:
        self.path = path
        self.config, self.config_json = _read_config(path)
        self.weight_map = weight_map
        self._files: list[_PreadFile] = []
        self._where: dict[str, _PreadFile] = {}
        try:
            for fname in files:
                f = _PreadFile(path / fname)
                self._files.append(f)
                self._add(f, weight_map)
        except BaseException:
            self.close()
            raise

    def _add(self, f: _PreadFile, weight_map: dict[str, str] | None) -> None:
        for name in f.tensors:
            if is_ignored(name):
                continue
            if name in self._where:
                raise CheckpointError(f"{f.path}: tensor {name!r} also stored in {self._where[name].path.name}")
            if weight_map is not None and weight_map.get(name, f.path.name) != f.path.name:
                raise CheckpointError(
                    f"{f.path}: holds tensor {name!r}, but the index places it in {weight_map[name]}"
                )
            self._where[name] = f
        if weight_map is not None:
            for name, fname in weight_map.items():
                if fname == f.path.name and name not in f.tensors:
                    raise CheckpointError(f"{f.path}: tensor {name!r} missing (the index places it here)")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: f.tensors[n].shape for n, f in self._where.items()}

    def order(self) -> list[str]:
        """Storage order (file, offset): reading in it is sequential on disk."""
        idx = {id(f): i for i, f in enumerate(self._files)}
        return sorted(self._where, key=lambda n: (idx[id(self._where[n])], self._where[n].tensors[n].begin))

    def dtype(self, name: str) -> str:
        return self._where[name].tensors[name].dtype

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._where[name].rows(name, start, stop)

    def byte_ranges(self, name: str, start: int, stop: int) -> list[ByteRange] | None:
        return [self._where[name].span(name, start, stop)]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self._where[name].tensors[name]
        return as_torch(self.raw_rows(name, start, stop), info.dtype, info.shape)

    def aux_files(self) -> dict[str, bytes]:
        return _aux_files(self.path)

    def close(self) -> None:
        for f in self._files:
            f.close()


class HFTorchBinSource:
    """An HF directory with pytorch_model.bin (or shards): loaded with weights_only and mmap, so
    only the rows asked for are ever paged in."""

    def __init__(self, path: Path, files: list[str], weight_map: dict[str, str] | None) -> None:
        import torch

        self.path = path
        self.config, self.config_json = _read_config(path)
        self.weight_map = weight_map
        self._tensors: dict[str, torch.Tensor] = {}
        for fname in files:
            fpath = path / fname
            try:
                sd = torch.load(fpath, map_location="cpu", weights_only=True, mmap=True)
            except FileNotFoundError:
                raise CheckpointError(f"{fpath}: file not found") from None
            except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad pickle/zip
                raise CheckpointError(f"{fpath}: cannot be read as a PyTorch checkpoint ({type(e).__name__})") from None
            if not isinstance(sd, dict):
                raise CheckpointError(f"{fpath}: expected a state dict, found {type(sd).__name__}")
            for name, t in sd.items():
                if isinstance(t, torch.Tensor) and not is_ignored(name):
                    self._tensors[str(name)] = t

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self._tensors.items()}

    def dtype(self, name: str) -> str:
        from tprt.checkpoint.safetensors_io import st_dtype

        return st_dtype(self._tensors[name].dtype)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        rows = self._tensors[name][start:stop]
        return rows.clone() if rows.is_contiguous() else rows.contiguous()  # never a view of the mmap

    def aux_files(self) -> dict[str, bytes]:
        return _aux_files(self.path)

    def close(self) -> None:
        self._tensors.clear()


def _read_index(index: Path) -> dict[str, str]:
    try:
        d = json.loads(index.read_text())
        wm = d["weight_map"]
        if not isinstance(wm, dict):
            raise TypeError
        return {str(k): str(v) for k, v in wm.items()}
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor names to shard files") from None


def _sharded(path: Path, index_name: str) -> tuple[list[str], dict[str, str]]:
    index = path / index_name
    wm = _read_index(index)
    files = sorted(set(wm.values()))
    for fname in files:
        if not (path / fname).is_file():
            raise CheckpointError(f"{path / fname}: missing; {index.name} lists it as a shard")
    return files, wm


def open_hf(path: Path) -> TensorSource:
    if (path / "model.safetensors.index.json").is_file():
        files, wm = _sharded(path, "model.safetensors.index.json")
        return HFSafetensorsSource(path, files, wm)
    if (path / "model.safetensors").is_file():
        return HFSafetensorsSource(path, ["model.safetensors"], None)
    if (path / "pytorch_model.bin.index.json").is_file():
        files, wm = _sharded(path, "pytorch_model.bin.index.json")
        return HFTorchBinSource(path, files, wm)
    if (path / "pytorch_model.bin").is_file():
        return HFTorchBinSource(path, ["pytorch_model.bin"], None)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: neither a Hugging Face model directory (no config.json) nor a TP checkpoint")
    raise CheckpointError(
        f"{path}: no weights found; expected model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


class TPSource:
    """A tprt TP checkpoint read back as the global model: rows are gathered from whichever rank
    holds them, vocabulary padding is dropped and replicated kv heads are read once."""

    def __init__(self, path: Path) -> None:
        ckpt = TPCheckpoint(path)
        self.path = path
        self.manifest = m = ckpt.manifest
        self.config, self.config_json = ckpt.config, dict(ckpt.config.raw)
        self.weight_map = m.hf_weight_map
        self._by_path: dict[Path, _PreadFile] = {}
        self._loc: dict[tuple[str, int], _PreadFile] = {}
        try:
            for rank in range(m.tp_size):
                self._open_rank(ckpt, rank)
        except BaseException:
            self.close()
            raise

    def _open_rank(self, ckpt: TPCheckpoint, rank: int) -> None:
        rf = ckpt.open_rank(rank)  # checks sizes, shapes and the tensor set against the manifest
        try:
            for name, entry in self.manifest.tensors.items():
                fpath, info = rf.locate(name)
                if info.dtype != entry.dtype:
                    raise CheckpointError(f"{fpath}: tensor {name!r} is {info.dtype}, manifest says {entry.dtype}")
                if fpath not in self._by_path:
                    self._by_path[fpath] = _PreadFile(fpath)
                self._loc[name, rank] = self._by_path[fpath]
        finally:
            rf.close()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, e in self.manifest.tensors.items():
            out[name] = (self.manifest.vocab_size, *e.shape[1:]) if name in VOCAB_TENSORS else e.shape
        return out

    def order(self) -> list[str]:
        f = self._loc
        return sorted(self.manifest.tensors, key=lambda n: (f[n, 0].path.name, f[n, 0].tensors[n].begin))

    def dtype(self, name: str) -> str:
        return self.manifest.tensors[name].dtype

    def _holders(self, name: str) -> list[tuple[int, int, int]]:
        """(rank, lo, hi) for each distinct slice along the split dimension."""
        seen: dict[int, tuple[int, int, int]] = {}
        for rank in range(self.manifest.tp_size):
            rng = self.manifest.local_range(name, rank)
            assert rng is not None
            seen.setdefault(rng[0], (rank, *rng))
        return list(seen.values())

    def byte_ranges(self, name: str, start: int, stop: int) -> list[ByteRange] | None:
        e = self.manifest.tensors[name]
        if e.split_dim is None:
            return [self._loc[name, 0].span(name, start, stop)]
        if e.split_dim != 0:
            return None
        out = []
        for rank, lo, hi in self._holders(name):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                out.append(self._loc[name, rank].span(name, a - lo, b - lo))
        return out

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        e = self.manifest.tensors[name]
        if e.split_dim is None:
            return self._loc[name, 0].rows(name, start, stop)
        rb = row_bytes(e.shape, DTYPE_SIZES[e.dtype])
        out = np.empty((stop - start, rb), dtype=np.uint8)
        if e.split_dim == 0:
            for rank, lo, hi in self._holders(name):
                a, b = max(start, lo), min(stop, hi)
                if a < b:
                    self._loc[name, rank].rows_into(name, a - lo, out[a - start : b - start])
            return out
        col = rb // e.shape[1]  # bytes per index along dim 1
        for rank, lo, hi in self._holders(name):
            out[:, lo * col : hi * col] = self._loc[name, rank].rows(name, start, stop)
        return out

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        e = self.manifest.tensors[name]
        return as_torch(self.raw_rows(name, start, stop), e.dtype, e.shape)

    def aux_files(self) -> dict[str, bytes]:
        return _aux_files(self.path)

    def close(self) -> None:
        for f in self._by_path.values():
            f.close()


def open_source(path: Path) -> TensorSource:
    """A TP checkpoint (a directory with tprt_manifest.json), an HF directory, or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        return TPSource(path) if is_tp_checkpoint(path) else open_hf(path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found")
        from convert.gguf import GGUFSource  # type: ignore[import-not-found,unused-ignore]

        src: TensorSource = GGUFSource(path)
        return src
    if not path.exists():
        raise CheckpointError(f"{path}: not found; expected an HF model directory, a TP checkpoint or a .gguf file")
    raise CheckpointError(f"{path}: expected an HF model directory, a TP checkpoint directory or a .gguf file")
