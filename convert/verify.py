"""`verify`: re-read a converted directory and list everything that disagrees with its manifest
(sizes, sha256, headers, shapes, dtypes) or with its config.json."""

from __future__ import annotations

from pathlib import Path

from convert.rules import check_tensor_set, is_quantized
from tprt.parallel.sharding import VOCAB_TENSORS
from convert.sources import open_hf
from tprt.checkpoint.hub import HubRepo
from tprt.checkpoint.format import MANIFEST_NAME, Manifest, is_tp_checkpoint
from tprt.model.config import ModelConfig, TPLayout
from tprt.errors import TprtError
from tprt.quant.formats import QuantSpec, check_groups, spec_from_extra
from tprt.checkpoint.safetensors_io import read_header, sha256_file


def verify(path: Path) -> list[str]:
    """Problems found, one line each; empty when the directory is sound."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a directory"]
    if not is_tp_checkpoint(path):
        return _verify_hf(path)
    try:
        manifest = Manifest.from_json((path / MANIFEST_NAME).read_text(), str(path / MANIFEST_NAME))
    except TprtError as e:
        return [str(e)]
    problems = _check_files(path, manifest)
    for rank in range(manifest.tp_size):
        problems += _check_rank(path, manifest, rank)
    problems += _check_config(path, manifest)
    return problems


def verify_hub(repo: HubRepo) -> list[str]:
    """A Hub model as downloaded into the cache (what the converter reads is fetched first, if
    missing): each safetensors file's sha256 against the Hub's (when online), then the same
    structural checks as a local HF directory (headers, tensor set and shapes vs config.json)."""
    try:
        repo.resolve()
        repo.config_json()
        shards, _ = repo.weight_files()
        paths = {name: repo.download(name) for name in shards}
    except TprtError as e:
        return [str(e)]
    problems = []
    for name, path in paths.items():
        want = (repo.sha256 or {}).get(name)
        if want is not None and sha256_file(path) != want:
            problems.append(f"{repo.label}: {name}: cached copy {path} differs from the Hub's (sha256 mismatch)")
    return problems + _verify_hf(paths[shards[0]].parent)


def _verify_hf(path: Path) -> list[str]:
    try:
        source = open_hf(path)
        try:
            check_tensor_set(source.shapes(), source.config, str(path))
        finally:
            source.close()
    except TprtError as e:
        return [str(e)]
    return []


def _check_files(path: Path, manifest: Manifest) -> list[str]:
    problems = []
    for name, entry in sorted(manifest.files.items()):
        f = path / name
        if not f.is_file():
            problems.append(f"{f}: missing (listed in {MANIFEST_NAME})")
        elif f.stat().st_size != entry.size:
            problems.append(f"{f}: size {f.stat().st_size} bytes, manifest says {entry.size}")
        elif sha256_file(f) != entry.sha256:
            problems.append(f"{f}: sha256 differs from the manifest (file corrupted or modified)")
    listed = set(manifest.files) | {MANIFEST_NAME}
    for f in sorted(path.glob("rank-*.safetensors")):
        if f.name not in listed:
            problems.append(f"{f}: not listed in {MANIFEST_NAME}")
    return problems


def _check_rank(path: Path, manifest: Manifest, rank: int) -> list[str]:
    names = manifest.rank_files(rank)
    if not names:
        return [f"{path / MANIFEST_NAME}: lists no file for rank {rank}"]
    problems: list[str] = []
    seen: set[str] = set()
    for fname in names:
        f = path / fname
        if not f.is_file():
            continue  # reported by _check_files
        try:
            tensors, _ = read_header(f)
        except TprtError as e:
            problems.append(str(e))
            continue
        for name, info in tensors.items():
            seen.add(name)
            entry = manifest.tensors.get(name)
            if entry is None:
                problems.append(f"{f}: tensor {name!r} is not in the manifest")
            elif info.shape != manifest.local_shape(name) or info.dtype != entry.dtype:
                problems.append(
                    f"{f}: tensor {name!r} is {info.dtype} {list(info.shape)}, manifest expects "
                    f"{entry.dtype} {list(manifest.local_shape(name))}"
                )
    if len(problems) == 0 and all((path / n).is_file() for n in names):
        for name in sorted(set(manifest.tensors) - seen):
            problems.append(f"{path}: rank {rank} is missing tensor {name!r}")
    return problems


def _check_config(path: Path, manifest: Manifest) -> list[str]:
    try:
        cfg = ModelConfig.from_file(path / "config.json")
        layout = TPLayout.for_model(cfg, manifest.tp_size, 1)
    except TprtError as e:
        return [str(e)]
    problems = []
    if cfg.vocab_size != manifest.vocab_size:
        problems.append(f"{path / MANIFEST_NAME}: vocab_size {manifest.vocab_size}, config.json says {cfg.vocab_size}")
    if manifest.padded_vocab_size % layout.tp or manifest.padded_vocab_size < cfg.vocab_size:
        problems.append(f"{path / MANIFEST_NAME}: padded_vocab_size {manifest.padded_vocab_size} is not valid for TP={layout.tp}")
    shapes = {n: ((cfg.vocab_size, *e.shape[1:]) if n in VOCAB_TENSORS else e.shape) for n, e in manifest.tensors.items()}
    try:
        spec = spec_from_extra(manifest.extra, str(path / MANIFEST_NAME))
        check_tensor_set(shapes, cfg, str(path / MANIFEST_NAME), spec)
    except TprtError as e:
        return [*problems, str(e)]
    if spec is not None:
        problems += _check_quantized(path, manifest, spec)
    for name in VOCAB_TENSORS:
        entry = manifest.tensors.get(name)
        if entry is not None and entry.shape[0] != manifest.padded_vocab_size:
            problems.append(
                f"{path / MANIFEST_NAME}: tensor {name!r} has {entry.shape[0]} rows, "
                f"padded vocabulary is {manifest.padded_vocab_size}"
            )
    return problems


def _check_quantized(path: Path, manifest: Manifest, spec: QuantSpec) -> list[str]:
    """Quantized weights in the format's dtype, float32 scales, groups whole on every rank."""
    problems = []
    for name, entry in manifest.tensors.items():
        if not is_quantized(name):
            continue
        scale = manifest.tensors[name + "_scale"]
        if entry.dtype != spec.safetensors_dtype or scale.dtype != "F32":
            problems.append(f"{path / MANIFEST_NAME}: {name!r} is {entry.dtype} with {scale.dtype} scales; "
                            f"weight_format {spec.name} stores {spec.safetensors_dtype} with F32 scales")
        try:
            check_groups(spec, name, entry.shape[1], manifest.tp_size if entry.split_dim == 1 else 1)
        except TprtError as e:
            problems.append(f"{path / MANIFEST_NAME}: {e}")
    return problems
