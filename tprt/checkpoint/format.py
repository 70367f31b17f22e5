"""The TP checkpoint format, shared by the converter, the runtime, the trainer and the server.

A TP checkpoint is a directory:

    config.json, tokenizer files      copied from the Hugging Face source
    tprt_manifest.json                 what follows, and a sha256 per file
    rank-00000-of-00004.safetensors    rank 0's slice of every tensor, under its HF name
    ...

Every rank file holds, under the tensor's Hugging Face name, the rank's slice of each sharded
tensor and a full copy of each replicated one; see `Manifest.local_shape`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tprt.model.config import ModelConfig
from tprt.errors import CheckpointError
from tprt.checkpoint.fsutil import write_text_atomic
from tprt.checkpoint.safetensors_io import SafetensorsFile, TensorInfo

if TYPE_CHECKING:
    import torch  # only for annotations: the converter reads rank files without importing torch

MANIFEST_NAME = "tprt_manifest.json"
FORMAT_NAME = "tprt-tp-checkpoint"
FORMAT_VERSION = 1
# Copied through from the source unchanged (when present).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def rank_file_name(rank: int, tp: int) -> str:
    return f"rank-{rank:05d}-of-{tp:05d}.safetensors"


@dataclass(frozen=True)
class TensorEntry:
    """One logical (global) tensor of the model."""

    shape: tuple[int, ...]  # global shape; vocabulary rows include TP padding
    dtype: str  # safetensors dtype name, e.g. "BF16"
    split_dim: int | None  # None: replicated whole on every rank
    kv_replication: int = 1  # >1: each kv head is held by this many consecutive ranks


@dataclass(frozen=True)
class FileEntry:
    rank: int  # -1 for the shared small files (config.json, tokenizer files): not a rank file
    size: int  # bytes
    sha256: str


@dataclass
class Manifest:
    tp_size: int
    vocab_size: int  # true vocabulary; ids at or above it are padding and never sampled
    padded_vocab_size: int
    dtype: str  # dtype of the floating-point weights, safetensors name
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]  # file name (relative) -> entry
    hf_weight_map: dict[str, str] | None = None  # source HF shard of each tensor, for tp-to-hf
    extra: dict[str, Any] = field(default_factory=dict)  # provenance: source, tool version, options

    def local_shape(self, name: str) -> tuple[int, ...]:
        """Shape of `name` inside one rank file."""
        e = self.tensors[name]
        if e.split_dim is None:
            return e.shape
        shape = list(e.shape)
        shape[e.split_dim] = e.shape[e.split_dim] * e.kv_replication // self.tp_size
        return tuple(shape)

    def local_range(self, name: str, rank: int) -> tuple[int, int] | None:
        """[start, stop) of `rank`'s slice along the split dimension, in global coordinates."""
        e = self.tensors[name]
        if e.split_dim is None:
            return None
        n = self.local_shape(name)[e.split_dim]
        start = (rank // e.kv_replication) * n
        return start, start + n

    def rank_files(self, rank: int) -> list[str]:
        return sorted(name for name, f in self.files.items() if f.rank == rank)

    def to_json(self) -> str:
        d = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "tp_size": self.tp_size,
            "vocab_size": self.vocab_size,
            "padded_vocab_size": self.padded_vocab_size,
            "dtype": self.dtype,
            "tensors": {k: _entry_json(v) for k, v in self.tensors.items()},
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
            "hf_weight_map": self.hf_weight_map,
            "extra": self.extra,
        }
        return json.dumps(d, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{source}: not a tprt manifest (field 'format' should be {FORMAT_NAME!r})")
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{source}: format_version {d.get('format_version')!r} is not supported (expected {FORMAT_VERSION})"
            )
        try:
            return cls(
                tp_size=int(d["tp_size"]),
                vocab_size=int(d["vocab_size"]),
                padded_vocab_size=int(d["padded_vocab_size"]),
                dtype=str(d["dtype"]),
                tensors={
                    k: TensorEntry(tuple(v["shape"]), v["dtype"], v["split_dim"], int(v.get("kv_replication", 1)))
                    for k, v in d["tensors"].items()
                },
                files={k: FileEntry(int(v["rank"]), int(v["size"]), str(v["sha256"])) for k, v in d["files"].items()},
                hf_weight_map=d.get("hf_weight_map"),
                extra=d.get("extra") or {},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: malformed manifest (field {e})") from None


def _entry_json(e: TensorEntry) -> dict[str, Any]:
    d: dict[str, Any] = {"shape": list(e.shape), "dtype": e.dtype, "split_dim": e.split_dim}
    if e.kv_replication != 1:
        d["kv_replication"] = e.kv_replication
    return d


def write_manifest(directory: Path, manifest: Manifest) -> None:
    write_text_atomic(directory / MANIFEST_NAME, manifest.to_json())


def is_tp_checkpoint(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


class TPCheckpoint:
    """A TP checkpoint directory: its config and manifest, and per-rank access to the weights."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory; expected a tprt TP checkpoint")
        mpath = self.path / MANIFEST_NAME
        if not mpath.is_file():
            raise CheckpointError(
                f"{self.path}: no {MANIFEST_NAME}; not a TP checkpoint (convert one with `tprt-convert hf-to-tp`)"
            )
        self.manifest = Manifest.from_json(mpath.read_text(), str(mpath))
        self.config = ModelConfig.from_file(self.path / "config.json")
        if self.config.vocab_size != self.manifest.vocab_size:
            raise CheckpointError(
                f"{mpath}: vocab_size {self.manifest.vocab_size} disagrees with config.json's {self.config.vocab_size}"
            )

    @property
    def tp_size(self) -> int:
        return self.manifest.tp_size

    def open_rank(self, rank: int) -> RankFiles:
        """Memory-maps `rank`'s files after checking they hold exactly the manifest's tensors."""
        if not 0 <= rank < self.tp_size:
            raise CheckpointError(f"{self.path}: rank {rank} out of range for TP={self.tp_size}")
        return RankFiles(self, rank)


class RankFiles:
    """One rank's mmapped files; `tensor(name)` is a zero-copy view of the rank's slice."""

    def __init__(self, ckpt: TPCheckpoint, rank: int) -> None:
        self.rank = rank
        self.manifest = ckpt.manifest
        self._where: dict[str, SafetensorsFile] = {}
        self._files: list[SafetensorsFile] = []
        names = ckpt.manifest.rank_files(rank)
        if not names:
            raise CheckpointError(f"{ckpt.path / MANIFEST_NAME}: lists no file for rank {rank}")
        for fname in names:
            fpath = ckpt.path / fname
            expected = ckpt.manifest.files[fname].size
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: missing (the manifest lists it for rank {rank})")
            if fpath.stat().st_size != expected:
                raise CheckpointError(f"{fpath}: size {fpath.stat().st_size} bytes, manifest says {expected}")
            f = SafetensorsFile(fpath)
            self._files.append(f)
            for name in f.tensors:
                self._where[name] = f
        for name in ckpt.manifest.tensors:
            info = self._info(name)
            want = ckpt.manifest.local_shape(name)
            if info.shape != want:
                raise CheckpointError(
                    f"{self._where[name].path}: tensor {name!r} has shape {list(info.shape)}, "
                    f"manifest expects {list(want)} on rank {rank}"
                )
        extra = set(self._where) - set(ckpt.manifest.tensors)
        if extra:
            raise CheckpointError(f"{ckpt.path}: rank {rank} holds tensors the manifest does not list: {sorted(extra)[:3]}")

    def _info(self, name: str) -> TensorInfo:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"rank {self.rank}: tensor {name!r} missing from its files")
        return f.info(name)

    def names(self) -> list[str]:
        return list(self._where)

    def locate(self, name: str) -> tuple[Path, TensorInfo]:
        """The file holding `name` and where inside it (for byte-range readers)."""
        info = self._info(name)
        return self._where[name].path, info

    def tensor(self, name: str) -> torch.Tensor:
        self._info(name)
        return self._where[name].tensor(name)

    def close(self) -> None:
        for f in self._files:
            f.close()
