"""What `tprt plan --model` accepts: an HF model directory, a config.json, a TP checkpoint, or a
Hub repo id (org/name)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tprt.errors import ConfigError
from tprt.model.config import ModelConfig

MANIFEST_NAME = "tprt_manifest.json"  # tprt.checkpoint.format's (not imported: it needs torch)
DEFAULT_VOCAB_ALIGN = 64  # tprt-convert's default
_SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


@dataclass(frozen=True)
class PlanSource:
    config: ModelConfig
    vocab_align: int  # the converter's rule: the vocabulary is padded to a multiple of vocab_align * tp
    checkpoint_tp: int | None  # the TP degree of a TP checkpoint, None for an HF model
    dtype: str | None = None  # a TP checkpoint's weights dtype (what the engine loads by default)


def read_source(path: Path, revision: str | None = None) -> PlanSource:
    """The model config (and, for a TP checkpoint, its vocab_align and TP degree) at `path`, or
    of the Hub repo `org/name` (at `revision`), whose config.json alone is fetched."""
    from tprt.checkpoint.hub import hub_config, is_hub_id

    if is_hub_id(path):
        return PlanSource(ModelConfig.from_file(hub_config(str(path), revision)), DEFAULT_VOCAB_ALIGN, None)
    if revision is not None:
        raise ConfigError(f"--revision applies to a Hub repo id (org/name), not to the local path {path}")
    if path.is_file():
        return PlanSource(ModelConfig.from_file(path), DEFAULT_VOCAB_ALIGN, None)
    if not path.is_dir():
        raise ConfigError(f"--model {path}: not found; expected an HF model directory, a config.json or a TP checkpoint")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {path}: no config.json in it; expected an HF model directory or a TP checkpoint")
    config = ModelConfig.from_file(path / "config.json")
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        return PlanSource(config, DEFAULT_VOCAB_ALIGN, None)
    try:
        m = json.loads(manifest.read_text())
        align = int(m.get("extra", {}).get("vocab_align", DEFAULT_VOCAB_ALIGN))
        return PlanSource(config, align, int(m["tp_size"]), _SAFETENSORS_DTYPES.get(str(m.get("dtype"))))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ConfigError(f"{manifest}: not a valid TP checkpoint manifest (expected tp_size and extra.vocab_align)") from None
