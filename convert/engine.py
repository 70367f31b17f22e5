"""The conversions: open and validate the source, plan the output, check the disk, stream the
copy into an atomic temporary directory, then write config, tokenizer files and manifest."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convert.copy import execute
from convert.hub_source import HubSource
from convert.plan import TORCH_NAMES, Plan, parse_dtype, parse_size, plan_hf, plan_tp
from convert.progress import Progress
from convert.resume import Journal
from convert.quantize import QuantizingSource
from convert.rules import check_tensor_set, expected_shapes, is_quantized
from convert.sources import TensorSource, TPSource, open_source
from tprt.checkpoint.format import MANIFEST_NAME, FileEntry, Manifest, write_manifest
from tprt.checkpoint.hub import HubRepo, is_hub_id
from tprt.model.config import TPLayout
from tprt.errors import ConfigError, OutputError
from tprt.parallel.sharding import ROW, rule_for
from tprt.quant.formats import QuantSpec, check_groups, spec_from_extra
from tprt.checkpoint.fsutil import atomic_output_dir, write_bytes_atomic

TOOL = "tprt-convert 0.1.0"
RESUME_DIR = "tprt-partial"  # an interrupted Hub conversion's output, kept to resume from
SPACE_MARGIN = 16 << 20  # headroom for the small files and the filesystem's own bookkeeping


@dataclass(frozen=True)
class HubOptions:
    """How to read a source that is a Hub repo id (`org/name`)."""

    revision: str | None = None
    token: str | None = None  # None: HF_TOKEN or the stored login
    stream: bool = False  # delete each newly downloaded shard once converted


@contextmanager
def opened(src: Path | str, hub: HubOptions | None = None) -> Iterator[TensorSource]:
    """The source at `src`: a local path, or a Hub repo id read through HubSource."""
    if is_hub_id(src):
        from convert.hub_source import HubSource

        hub = hub or HubOptions()
        source: TensorSource = HubSource(HubRepo(str(src), hub.revision, hub.token).resolve(), hub.stream)
    else:
        if hub is not None and (hub.revision or hub.stream):
            raise ConfigError(f"{src}: --revision and --stream apply to a Hub repo id (org/name), not a local path")
        source = open_source(Path(src))
    try:
        yield source
    finally:
        source.close()


def source_spec(source: TensorSource) -> QuantSpec | None:
    """The quantized format a source's weights are stored in (a quantized TP checkpoint), or None."""
    if isinstance(source, TPSource):
        return spec_from_extra(source.manifest.extra, str(source.path / MANIFEST_NAME))
    return None


def validated_names(source: TensorSource) -> list[str]:
    """The tensors to convert, in the source's storage order, after checking the set against
    config.json (missing, unexpected or mis-shaped tensors are errors)."""
    shapes = source.shapes()
    spec = source_spec(source)
    check_tensor_set(shapes, source.config, str(source.path), spec)
    wanted = expected_shapes(source.config, spec)
    order = getattr(source, "order", None)
    names: list[str] = order() if callable(order) else sorted(shapes)
    return [n for n in names if n in wanted]


def _refuse_existing(dst: Path, force: bool) -> None:
    """Fail before reading anything (atomic_output_dir checks again at the end)."""
    if Path(dst).exists() and not force:
        raise ConfigError(f"{dst}: DST already exists; choose another path or pass --force to replace it")


def check_free_space(dst: Path, nbytes: int) -> None:
    parent = Path(dst).resolve().parent
    if not parent.is_dir():  # before disk_usage, which would fail with a traceback
        raise ConfigError(f"{parent}: parent directory of DST does not exist; create it first")
    free = shutil.disk_usage(parent).free
    if nbytes + SPACE_MARGIN > free:
        raise OutputError(
            f"{parent}: not enough free space for {Path(dst).name}: need {_gb(nbytes + SPACE_MARGIN)}, "
            f"{_gb(free)} available"
        )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def output_config(source: TensorSource, dtype: str | None) -> dict[str, Any]:
    """The source's config.json, with its dtype field(s) updated when --dtype changes it."""
    cfg = dict(source.config_json)
    if dtype is not None:
        keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
        for k in keys:
            cfg[k] = TORCH_NAMES[dtype]
    return cfg


def _write_small_files(directory: Path, source: TensorSource, dtype: str | None) -> dict[str, FileEntry]:
    files = dict(source.aux_files())
    files["config.json"] = (json.dumps(output_config(source, dtype), indent=2) + "\n").encode()
    entries = {}
    for name, data in sorted(files.items()):
        write_bytes_atomic(directory / name, data)
        entries[name] = FileEntry(-1, len(data), hashlib.sha256(data).hexdigest())
    return entries


def _small_files_size(source: TensorSource) -> int:
    return sum(len(b) for b in source.aux_files().values()) + 64 * 1024


def _run_plan(plan: Plan, source: TensorSource, tmp: Path, dst: Path, progress: bool, desc: str,
              journal: Journal | None = None) -> dict[str, FileEntry]:
    origin = source.inner if isinstance(source, QuantizingSource) else source
    hub = isinstance(origin, HubSource)
    with Progress(plan.total_bytes, progress, desc + (" (download+convert)" if hub else "")) as bar:
        if isinstance(origin, HubSource):
            origin.attach(bar)
        done = execute(plan, source, tmp, bar, dst, journal)
    return {f.name: FileEntry(f.rank, *done[f.name]) for f in plan.files}


def convert_to_tp(
    src: Path | str, dst: Path, tp: int, dtype: str | None = None, vocab_align: int | None = None,
    force: bool = False, progress: bool = False, hub: HubOptions | None = None,
    quantize: QuantSpec | None = None,
) -> Manifest:
    """Any source -> a TP checkpoint with `tp` ranks. vocab_align None: the source checkpoint's
    (when it is a TP checkpoint), else 64. `quantize`: the decoder's linear weights quantized in
    the stream (tprt.quant); a quantized TP source keeps its format."""
    out_dtype = parse_dtype(dtype)
    _refuse_existing(dst, force)
    with opened(src, hub) as source:
        names = validated_names(source)
        if vocab_align is None:
            vocab_align = _source_vocab_align(source)
        layout = TPLayout.for_model(source.config, tp, vocab_align)
        spec = _output_spec(source, quantize)
        if quantize is not None and spec is quantize:
            source = QuantizingSource(source, quantize)
            names = source.names(names)
        if spec is not None:
            _check_whole_groups(names, source.shapes(), spec, tp)
        shapes = source.shapes()
        dtypes = {n: source.dtype(n) for n in names}
        plan, manifest = plan_tp(names, shapes, dtypes, source.config, layout, out_dtype)
        manifest.hf_weight_map = _weight_map(source, names)
        manifest.extra = {"tool": TOOL, "source": str(src), "source_format": _format_of(source),
                          "vocab_align": vocab_align, **(spec.to_extra() if spec is not None else {})}
        origin = source.inner if isinstance(source, QuantizingSource) else source
        if isinstance(origin, HubSource):
            manifest.extra["source_commit"] = origin.repo.commit
        resumable = isinstance(origin, HubSource)  # a rerun fetches and reads only what is left
        kept = _kept_bytes(Path(dst)) if resumable else 0
        check_free_space(dst, plan.total_bytes + _small_files_size(source) - kept)
        with atomic_output_dir(dst, force, keep=RESUME_DIR if resumable else None) as tmp:
            journal = Journal(tmp, _plan_key(manifest, plan)) if resumable else None
            files = _run_plan(plan, source, tmp, Path(dst), progress, f"TP={tp}", journal)
            files.update(_write_small_files(tmp, source, out_dtype))
            manifest.files = files
            write_manifest(tmp, manifest)
    return manifest


def _output_spec(source: TensorSource, quantize: QuantSpec | None) -> QuantSpec | None:
    """The output's weight format: the source's when it is quantized (a requantization is
    refused), else `quantize`."""
    stored = source_spec(source)
    if stored is None:
        return quantize
    if quantize is not None and quantize != stored:
        raise ConfigError(f"{source.path}: its weights are already {stored.name} (group_size {stored.group_size}); "
                          f"--quantize {quantize.name} with group_size {quantize.group_size} would quantize them "
                          "twice: convert the original float checkpoint instead")
    return stored


def _check_whole_groups(names: list[str], shapes: dict[str, tuple[int, ...]], spec: QuantSpec, tp: int) -> None:
    """Each quantized weight's groups stay whole on every rank (row-parallel layers split its columns)."""
    for name in names:
        if is_quantized(name):
            split = tp if rule_for(name).kind == ROW else 1
            check_groups(spec, name, shapes[name][1], split)


def _kept_bytes(dst: Path) -> int:
    """Bytes an interrupted run left in DST's resume directory (already on the disk)."""
    partial = dst.parent / f".{dst.name}.{RESUME_DIR}"
    return sum(f.stat().st_size for f in partial.iterdir() if f.is_file()) if partial.is_dir() else 0


def _plan_key(manifest: Manifest, plan: Plan) -> str:
    """Identifies the output exactly (source commit, layout, every file's tensors and size), so a
    resumed run continues only the same conversion."""
    what = {"extra": manifest.extra, "files": [(f.name, f.entries, f.size) for f in plan.files]}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _source_vocab_align(source: TensorSource) -> int:
    if isinstance(source, TPSource):
        align = source.manifest.extra.get("vocab_align")
        if isinstance(align, int) and align > 0:
            return align
    return 64


def _format_of(source: TensorSource) -> str:
    if isinstance(source, QuantizingSource):
        return _format_of(source.inner)
    if isinstance(source, TPSource):
        return "tp"
    if isinstance(source, HubSource):
        return "hf"
    return "gguf" if source.path.suffix.lower() == ".gguf" else "hf"


def _weight_map(source: TensorSource, names: list[str]) -> dict[str, str] | None:
    wm = source.weight_map
    if wm is None:
        return None
    return {n: wm[n] for n in names if n in wm}


def convert_to_hf(
    src: Path, dst: Path, dtype: str | None = None, force: bool = False, progress: bool = False,
    max_shard_size: int | str | None = None, hub: HubOptions | None = None,
) -> list[str]:
    """Any source -> an HF directory; returns the safetensors file names written. The source's
    shard layout is reproduced unless `max_shard_size` is given (default grouping: 5GB shards)."""
    out_dtype = parse_dtype(dtype)
    max_shard = None if max_shard_size is None else parse_size(max_shard_size)
    _refuse_existing(dst, force)
    with opened(src, hub) as source:
        spec = source_spec(source)
        if spec is not None:
            raise ConfigError(f"{source.path}: holds {spec.name} weights (weight_format {spec.name}); transformers "
                              "cannot load them as a plain Llama, and tp-to-hf does not dequantize: export the "
                              "float checkpoint it was converted from")
        names = validated_names(source)
        shapes = source.shapes()
        dtypes = {n: source.dtype(n) for n in names}
        plan = plan_hf(names, shapes, dtypes, out_dtype, source.weight_map, max_shard)
        check_free_space(dst, plan.total_bytes + _small_files_size(source))
        with atomic_output_dir(dst, force) as tmp:
            files = _run_plan(plan, source, tmp, Path(dst), progress, "HF")
            _write_small_files(tmp, source, out_dtype)
            if [f.name for f in plan.files] != ["model.safetensors"]:
                _write_index(tmp, plan)
    return [f.name for f in plan.files]


def _write_index(directory: Path, plan: Plan) -> None:
    weight_map = {n: f.name for f in plan.files for n, _, _ in f.entries}
    index = {
        "metadata": {"total_size": sum(f.data_bytes for f in plan.files)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_bytes_atomic(directory / "model.safetensors.index.json", (json.dumps(index, indent=2) + "\n").encode())
