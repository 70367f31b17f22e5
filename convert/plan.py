"""What to write where: output files with headers known up front, and for every tensor the
pieces of it that each output file receives. Pure functions of shapes and options; no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from convert.rules import tp_entry
from tprt.checkpoint.format import Manifest, rank_file_name
from tprt.model.config import ModelConfig, TPLayout
from tprt.errors import ConfigError
from tprt.parallel.sharding import SCALE_SUFFIX
from tprt.checkpoint.safetensors_io import DTYPE_SIZES, build_header

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
DTYPE_ALIASES = {
    "bf16": "BF16", "bfloat16": "BF16",
    "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
    "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32",
}
TORCH_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
HF_METADATA = {"format": "pt"}
DEFAULT_MAX_SHARD = 5 * 1000**3  # transformers' "5GB"


def parse_dtype(dtype: str | None) -> str | None:
    """--dtype value -> safetensors dtype name; None keeps each tensor's dtype."""
    if dtype is None:
        return None
    try:
        return DTYPE_ALIASES[dtype.lower()]
    except KeyError:
        raise ConfigError(f"--dtype {dtype!r} is not supported; expected bf16, fp16 or fp32") from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """'5GB' (powers of 1000, as transformers), '512MiB' (powers of 1024), or a byte count."""
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE.match(size)
        if not m:
            raise ConfigError(f"--max-shard-size {size!r}: expected a size such as 5GB, 500MB or 2GiB")
        base = 1024 if (m.group(3) or "").upper() == "IB" else 1000
        value = int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))
    if value <= 0:
        raise ConfigError(f"--max-shard-size must be positive, got {size!r}")
    return value


@dataclass(frozen=True)
class Piece:
    """The part of a tensor that one output file holds."""

    file: int  # index into Plan.files
    split_dim: int | None  # None: the whole tensor; 0: rows [lo, hi); 1: columns [lo, hi)
    lo: int
    hi: int


@dataclass
class TensorPlan:
    name: str
    src_dtype: str
    out_dtype: str
    shape: tuple[int, ...]  # global output shape, vocabulary padding included
    real_rows: int  # rows [0, real_rows) come from the source; the rest are zero padding
    pieces: list[Piece]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * DTYPE_SIZES[self.out_dtype]

    @property
    def src_row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * DTYPE_SIZES[self.src_dtype]


@dataclass
class OutFile:
    name: str
    rank: int  # TP rank; -1 for an HF shard
    entries: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)  # (tensor, dtype, shape)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * DTYPE_SIZES[d] for _, d, s in self.entries)

    @property
    def size(self) -> int:
        return len(build_header(self.entries, self.metadata)) + self.data_bytes


@dataclass
class Plan:
    tensors: list[TensorPlan]  # in the order their bytes are written
    files: list[OutFile]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def out_dtype_of(src_dtype: str, dtype: str | None) -> str:
    return dtype if dtype is not None and src_dtype in FLOAT_DTYPES else src_dtype


def plan_tp(
    names: list[str],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    cfg: ModelConfig,
    layout: TPLayout,
    dtype: str | None,
) -> tuple[Plan, Manifest]:
    """One rank file per rank, every tensor in `names` order in each; the manifest without files."""
    # A quantized weight's scales stay float32 whatever --dtype says (tprt.quant).
    tensors = {n: tp_entry(n, shapes[n], dtypes[n] if n.endswith(SCALE_SUFFIX) else out_dtype_of(dtypes[n], dtype),
                           layout) for n in names}
    emb = tensors["model.embed_tokens.weight"]
    manifest = Manifest(layout.tp, cfg.vocab_size, layout.padded_vocab_size, emb.dtype, tensors, {})
    files = [OutFile(rank_file_name(r, layout.tp), r, metadata=dict(HF_METADATA)) for r in range(layout.tp)]
    plans = []
    for name in names:
        e = tensors[name]
        pieces = []
        for r, f in enumerate(files):
            f.entries.append((name, e.dtype, manifest.local_shape(name)))
            rng = manifest.local_range(name, r)
            pieces.append(Piece(r, None, 0, e.shape[0]) if rng is None else Piece(r, e.split_dim, *rng))
        plans.append(TensorPlan(name, dtypes[name], e.dtype, e.shape, shapes[name][0], pieces))
    return Plan(plans, files), manifest


def hf_shard_name(source_name: str) -> str:
    """The safetensors name of a source shard (pytorch_model-00001-of-00002.bin -> model-00001-...)."""
    if source_name.endswith(".safetensors"):
        return source_name
    stem = source_name.removesuffix(".bin")
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model") :]
    return stem + ".safetensors"


def _group_by_size(names: list[str], nbytes: dict[str, int], max_shard: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if groups[-1] and size + nbytes[name] > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes[name]
    return groups


def hf_groups(
    names: list[str], nbytes: dict[str, int], weight_map: dict[str, str] | None, max_shard: int | None
) -> dict[str, list[str]]:
    """Output shard file -> its tensors: the source's grouping when `weight_map` covers every tensor
    and no explicit `max_shard` asks otherwise, else greedy packing up to `max_shard` bytes."""
    if max_shard is None and weight_map is not None and all(n in weight_map for n in names):
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(hf_shard_name(weight_map[name]), []).append(name)
        return dict(sorted(groups.items()))
    packed = _group_by_size(names, nbytes, max_shard or DEFAULT_MAX_SHARD)
    if len(packed) == 1:
        return {"model.safetensors": packed[0]}
    return {f"model-{k + 1:05d}-of-{len(packed):05d}.safetensors": g for k, g in enumerate(packed)}


def plan_hf(
    names: list[str],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    dtype: str | None,
    weight_map: dict[str, str] | None,
    max_shard: int | None,
) -> Plan:
    """HF shard files; each tensor whole in exactly one of them."""
    out_dtypes = {n: out_dtype_of(dtypes[n], dtype) for n in names}
    nbytes = {n: int(np.prod(shapes[n], dtype=np.int64)) * DTYPE_SIZES[out_dtypes[n]] for n in names}
    files, plans = [], []
    for k, (fname, group) in enumerate(hf_groups(names, nbytes, weight_map, max_shard).items()):
        files.append(OutFile(fname, -1, [(n, out_dtypes[n], shapes[n]) for n in group], dict(HF_METADATA)))
        for n in group:
            plans.append(TensorPlan(n, dtypes[n], out_dtypes[n], shapes[n], shapes[n][0], [Piece(k, None, 0, shapes[n][0])]))
    return Plan(plans, files)
