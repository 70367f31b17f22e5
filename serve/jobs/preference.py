"""A fine-tuning job's preference-tuning side (OBJECTIVE_DPO) and its starting adapter, for
serve/jobs/spec.py's `check_create`: DPO's hyper-parameters checked and defaulted, and an earlier
job's adapter (named by adapter id or job id) resolved under --data-dir, its rank and alpha made
the job's."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serve.errors import FailedPrecondition, InvalidArgument, NotFound, echo
from serve.jobs.request import JobRequest
from serve.jobs.store import SUCCEEDED, JobStore
from serve.paths import check_files_inside
from tprt.errors import ConfigError, TprtError
from tprt.train.dpo_advice import DEFAULT_BETA, DEFAULT_RPO_ALPHA

ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_DIR = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # an adapter id, as serve/jobs/spec.py's ADAPTER_ID

# DPO's numeric hyper-parameters (OBJECTIVE_DPO only): name -> (default, low, high, brackets), the
# brackets "(" / "[" and ")" / "]" saying which ends are open. rpo_alpha: tprt/train/dpo.py (RPO).
_DPO_HP: dict[str, tuple[float, float, float, str]] = {"beta": (DEFAULT_BETA, 0.0, 100.0, "()"),
                                                       "label_smoothing": (0.0, 0.0, 0.5, "[)"),
                                                       "rpo_alpha": (DEFAULT_RPO_ALPHA, 0.0, 100.0, "[]")}
DPO_LOSSES = ("sigmoid", "ipo")
DPO_HYPERPARAMETERS = (*_DPO_HP, "dpo_loss")


def dpo_hyperparameters(hp: Mapping[str, Any], objective: str) -> dict[str, Any]:
    """beta, dpo_loss, label_smoothing and rpo_alpha (of those the caller set, `hp`) with defaults filled in
    for a DPO job, range-checked; none for a supervised one, which may not set them."""
    if objective != "dpo":
        for name in DPO_HYPERPARAMETERS:
            if name in hp:
                raise InvalidArgument("applies to OBJECTIVE_DPO jobs only", f"hyperparameters.{name}")
        return {}
    out: dict[str, Any] = {}
    for name, (default, low, high, brackets) in _DPO_HP.items():
        value = hp.get(name, default)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if number else value  # an integer is shown as the float it becomes
        if not (number and math.isfinite(value) and (value > low if brackets[0] == "(" else value >= low)
                and (value < high if brackets[1] == ")" else value <= high)):
            raise InvalidArgument(f"must be a number in {brackets[0]}{low}, {high}{brackets[1]}, got "
                                  f"{str(value)[:40]}", f"hyperparameters.{name}")
        out[name] = value
    out["dpo_loss"] = hp.get("dpo_loss", "sigmoid")
    if out["dpo_loss"] not in DPO_LOSSES:
        raise InvalidArgument(f"must be one of {', '.join(DPO_LOSSES)}, got {echo(str(out['dpo_loss'])[:40])}",
                              "hyperparameters.dpo_loss")
    if out["label_smoothing"] and out["dpo_loss"] != "sigmoid":
        raise InvalidArgument("applies to dpo_loss 'sigmoid' only", "hyperparameters.label_smoothing")
    return out


def resolve_init_adapter(name: str, store: JobStore, data_dir: Path) -> Path:
    """The adapter a LoRA job starts from: a succeeded LoRA job's (by adapter id or job id), or one
    under --data-dir/adapters/; NotFound naming `init_adapter` otherwise."""
    root = data_dir.resolve()
    for rec in store.select(SUCCEEDED, limit=1_000_000):
        if rec.method == "lora" and rec.output_path and name in (rec.adapter_id, rec.id):
            return _inside(data_dir / rec.output_path, root, name)
    if adapter_on_disk(name, data_dir):
        return _inside(data_dir / "adapters" / name, root, name)
    raise NotFound(f"no adapter {echo(name)}: name a succeeded LoRA job's adapter id or job id", "init_adapter")


def adapter_on_disk(name: str, data_dir: Path) -> bool:
    """Whether --data-dir/adapters/<name>/ holds an adapter (served on demand by that id)."""
    return bool(_ADAPTER_DIR.fullmatch(name)) and (data_dir / "adapters" / name / ADAPTER_CONFIG).is_file()


def _inside(path: Path, root: Path, name: str) -> Path:
    """`path`, when it and every file in it resolve inside --data-dir (symlinks followed)."""
    try:
        inside = path.resolve().is_relative_to(root)
    except (OSError, RuntimeError, ValueError):
        inside = False
    if not inside:
        raise InvalidArgument(f"{echo(name)} leads outside the server's --data-dir", "init_adapter")
    check_files_inside(path, root, name, "init_adapter")
    return path


def start_from(request: JobRequest, method: str, hp: dict[str, Any], store: JobStore, data_dir: Path) -> str:
    """The job's init_adapter (relative to --data-dir; "" for none); its rank and alpha become the job's."""
    if not request.init_adapter:
        return ""
    if method != "lora":
        raise InvalidArgument("a full fine-tune starts from the base model, not an adapter", "init_adapter")
    from tprt.lora.peft_io import read_adapter_config, read_config_file

    path = resolve_init_adapter(request.init_adapter, store, data_dir)
    try:
        _, rank, alpha, _ = read_adapter_config(read_config_file(path, "adapter_config.json", ConfigError))
    except TprtError as e:
        raise FailedPrecondition(f"{echo(request.init_adapter)}: {e}", "init_adapter") from None
    for key, own in (("lora_rank", rank), ("lora_alpha", alpha)):
        if key in request.hyperparameters and hp[key] != own:
            raise InvalidArgument(f"{hp[key]} differs from init_adapter's {own}", f"hyperparameters.{key}")
        hp[key] = own
    return str(path.relative_to(data_dir))
