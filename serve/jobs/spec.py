"""Job requests (serve/jobs/request.py, from either front end) -> checked job records; training configs.

Every hyper-parameter is range-checked (INVALID_ARGUMENT naming `hyperparameters.<name>`,
OUT_OF_RANGE for a max_seq_len beyond the served context). Dataset paths are resolved inside
--data-dir (symlinks included) and refused outside it; inline JSONL is written into the job's
directory. The dataset is read, tokenized and packed before the job is accepted, so a bad line
is an INVALID_ARGUMENT naming the line, not a failed job later.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.errors import AlreadyExists, echo, FailedPrecondition, InvalidArgument, NotFound, OutOfRange
from serve.jobs.preference import DPO_HYPERPARAMETERS, dpo_hyperparameters, start_from
from serve.jobs.request import METHODS, OBJECTIVES, JobRequest
from serve.jobs.store import JobRecord, JobStore, new_job_id
from serve.jobs.storage import ensure_room
from tprt.errors import TprtError

ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DATASET_FILE = "dataset.jsonl"
DEFAULT_MAX_DATASET_BYTES = 64 << 20  # --max-dataset-bytes: inline JSONL and dataset files

# name -> (default LoRA, default full, low, high, integer); None defaults are filled in below.
# batch_size counts examples (one per row, serve.jobs.spec.load_dataset), as OpenAI's API does. The
# LoRA rate 1e-3 is one with which a few epochs over a small file visibly teach an answer: 16
# chats, n_epochs 2, batch 1 (32 steps) end at a loss of 0.006 and SmolLM2 answers with the taught
# name (tests/test_smollm2.py); at the old 1e-4 the same job ended at 3.5 and had learned nothing.
_HP: dict[str, tuple[Any, Any, float, float, bool]] = {
    "steps": (100, 100, 1, 1_000_000, True),
    "learning_rate": (1e-3, 1e-5, 0.0, 1.0, False),
    "batch_size": (4, 4, 1, 1024, True),
    "max_seq_len": (None, None, 2, 1 << 20, True),
    "lora_rank": (8, None, 1, 1024, True),
    "lora_alpha": (16.0, None, 0.0, 1e6, False),
    "weight_decay": (0.0, 0.0, 0.0, 10.0, False),
    "warmup_steps": (0, 0, 0, 1_000_000, True),
    "seed": (0, 0, 0, 2**63 - 1, True),
    "checkpoint_every": (50, 50, 1, 1_000_000, True),
}
_LOW_OPEN = {"learning_rate", "lora_alpha"}


def default_of(name: str, method: str) -> Any:
    """A hyper-parameter's default for "lora" or "full" (None: it depends on the server)."""
    d_lora, d_full, *_ = _HP[name]
    return d_lora if method == "lora" else d_full


@dataclass
class JobSpec:
    """A checked CreateJob: the record to store (its dataset was read and found trainable)."""

    record: JobRecord


def checked_value(name: str, value: Any) -> int | float:
    """One hyper-parameter's value in its range; InvalidArgument naming `hyperparameters.<name>` otherwise."""
    _, _, low, high, integer = _HP[name]
    ok = (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if name in _LOW_OPEN else value >= low) and value <= high
          and (not integer or float(value).is_integer()))
    if not ok:
        span = f"({low}, {high}]" if name in _LOW_OPEN else f"[{low}, {high}]"
        kind = "an integer" if integer else "a number"
        raise InvalidArgument(f"must be {kind} in {span}, got {str(value)[:40]}", f"hyperparameters.{name}")
    return int(value) if integer else float(value)


def hyperparameters(hp: Mapping[str, Any], method: str, context: int) -> dict[str, Any]:
    """The hyper-parameters the caller set (`hp`) with every other default filled in, range-checked."""
    out: dict[str, Any] = {}
    for name, (d_lora, d_full, *_) in _HP.items():
        given = name in hp
        if method == "full" and name.startswith("lora_"):
            if given:
                raise InvalidArgument("LoRA settings do not apply to METHOD_FULL", f"hyperparameters.{name}")
            continue
        value = hp[name] if given else (d_lora if method == "lora" else d_full)
        if name == "max_seq_len" and not given:
            value = min(512, context)
        out[name] = checked_value(name, value)
    if out["max_seq_len"] > context:
        raise OutOfRange(f"{out['max_seq_len']} is beyond the served context of {context} tokens",
                         "hyperparameters.max_seq_len")
    if out["warmup_steps"] > out["steps"]:
        raise InvalidArgument(f"{out['warmup_steps']} is more than steps={out['steps']}", "hyperparameters.warmup_steps")
    return out


MAX_PATH_BYTES = 4096  # PATH_MAX on Linux: a longer path cannot name a file
MAX_NAME_BYTES = 255  # NAME_MAX, per path component


def resolve_dataset(data_dir: Path, given: str, field: str = "dataset_path") -> Path:
    """`given` (relative to --data-dir, or absolute) as a regular file inside --data-dir; errors name `field`."""
    if not given:
        raise InvalidArgument("empty path", field)
    if "\0" in given:
        raise InvalidArgument("a path cannot contain a NUL byte", field)
    raw = given.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in raw.split(b"/")):
        raise InvalidArgument(f"a path is at most {MAX_PATH_BYTES} bytes, {MAX_NAME_BYTES} per component",
                              field)
    root = data_dir.resolve()
    try:
        path = (root / given).resolve()
        exists, regular = path.exists(), path.is_file()
    except (OSError, ValueError) as e:  # a loop of symlinks, a component that is not a directory, ...
        raise InvalidArgument(f"{echo(given)} cannot be resolved ({type(e).__name__})", field) from None
    if not path.is_relative_to(root):
        raise InvalidArgument(f"{echo(given)} is outside the server's --data-dir", field)
    if not exists:
        raise NotFound(f"{echo(given)} does not exist under the server's --data-dir", field)
    if not regular:
        raise InvalidArgument(f"{echo(given)} is not a regular file", field)
    return path


def _adapter_id(request: JobRequest, method: str, job_id: str, store: JobStore, taken: Any) -> str:
    if method == "full":
        if request.adapter_id:
            raise InvalidArgument("a full fine-tune produces a model, not an adapter", "adapter_id")
        return ""
    aid = request.adapter_id or job_id
    if not ADAPTER_ID.fullmatch(aid):  # fullmatch: `$` would let a trailing newline through
        raise InvalidArgument("1-64 characters: letters, digits, '.', '_', '-' (starting with a letter or digit)",
                              "adapter_id")
    if taken(aid) or store.adapter_taken(aid):
        raise AlreadyExists(f"adapter id {aid!r} is already used", "adapter_id")  # the early look; JobStore.create claims it
    return aid


def _check_dataset_size(size: int, limit: int, field: str) -> None:
    if size > limit:
        raise InvalidArgument(f"{size} bytes; the server takes datasets of at most {limit} bytes "
                              "(--max-dataset-bytes)", field)


def check_create(request: JobRequest, store: JobStore, data_dir: Path, tokenizer: Any, context: int,
                 adapter_taken: Any, max_dataset_bytes: int = DEFAULT_MAX_DATASET_BYTES,
                 admit: Callable[[str, dict[str, Any]], None] | None = None) -> JobSpec:
    """Everything about a job request, checked; writes inline data into the job's directory.
    `admit(method, hyperparameters)` refuses a job too large for the server's memory
    (serve/jobs/admission.py), and a dataset over `max_dataset_bytes` is refused, before anything is
    written or read."""
    data_dir = data_dir.resolve()
    if tokenizer is None:
        raise FailedPrecondition("the served model has no tokenizer; fine-tuning needs one", "dataset")
    method, objective = request.method, request.objective
    if method not in METHODS:  # the front ends map their own spellings (with their own errors) first
        raise InvalidArgument(f"unknown method {echo(method)}; {' or '.join(METHODS)}", "method")
    if objective not in OBJECTIVES:
        raise InvalidArgument(f"unknown objective {echo(objective)}; {' or '.join(OBJECTIVES)}", "objective")
    for name in request.hyperparameters:
        if name not in _HP and name not in DPO_HYPERPARAMETERS:
            raise InvalidArgument("no such hyper-parameter", f"hyperparameters.{name}")
    hp = hyperparameters(request.hyperparameters, method, context)
    hp.update(dpo_hyperparameters(request.hyperparameters, objective))
    init_adapter = start_from(request, method, hp, store, data_dir)
    if admit is not None:
        admit(method, hp)
    job_id = new_job_id()
    aid = _adapter_id(request, method, job_id, store, adapter_taken)
    inline = request.inline_jsonl
    job_dir = data_dir / "jobs" / job_id
    if request.dataset_path is None and inline is None:
        raise InvalidArgument("set dataset_path or inline_jsonl", "dataset")
    if request.dataset_path is not None and inline is not None:
        raise InvalidArgument("set dataset_path or inline_jsonl, not both", "dataset")
    which = "dataset_path" if inline is None else "inline_jsonl"
    if request.dataset_path is not None:
        path = resolve_dataset(data_dir, request.dataset_path)
        _check_dataset_size(path.stat().st_size, max_dataset_bytes, "dataset_path")
    else:
        assert inline is not None
        _check_dataset_size(len(inline.encode("utf-8")), max_dataset_bytes, "inline_jsonl")
        if not inline.strip():
            raise InvalidArgument("empty dataset", "inline_jsonl")
        path = job_dir / DATASET_FILE
    validation = ""
    if request.validation_dataset_path:
        held_out = resolve_dataset(data_dir, request.validation_dataset_path, "validation_dataset_path")
        _check_dataset_size(held_out.stat().st_size, max_dataset_bytes, "validation_dataset_path")
        _check_documents(held_out, tokenizer, hp, "validation_dataset_path", objective)
        validation = str(held_out.relative_to(data_dir))
    ensure_room(data_dir, len(inline.encode("utf-8")) if inline is not None else 0)
    try:  # a refused request leaves nothing on disk
        if inline is not None:
            job_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(inline)
        rec = JobRecord(id=job_id, method=method, dataset=str(path.relative_to(data_dir)), adapter_id=aid,
                        hyperparameters=hp, validation_dataset=validation, objective=objective,
                        init_adapter=init_adapter)
        try:
            load_dataset(rec, data_dir, tokenizer)  # refused now, not failed later; not kept (JobManager)
        except TprtError as e:
            raise InvalidArgument(f"{e}", which) from None
    except BaseException:
        shutil.rmtree(job_dir, ignore_errors=True)
        raise
    rec.total_steps = hp["steps"]
    return JobSpec(rec)


def _check_documents(path: Path, tokenizer: Any, hp: dict[str, Any], field: str, objective: str) -> None:
    """Refuses a JSONL file training could not read, naming `field`."""
    from tprt.train.data import load_documents
    from tprt.train.preference import load_pairs

    try:
        if objective == "dpo":
            load_pairs(path, tokenizer, int(hp["max_seq_len"]))
            return
        docs, _ = load_documents(path, tokenizer, int(hp["max_seq_len"]), True)
    except TprtError as e:
        raise InvalidArgument(f"{e}", field) from None
    if not any(d.n_targets for d in docs):
        raise InvalidArgument("no example has a token to evaluate on (empty, all masked or truncated away)", field)


def load_dataset(rec: JobRecord, data_dir: Path, tokenizer: Any) -> Any:
    """Reads and tokenizes the job's JSONL, and its held-out JSONL if any (tprt.train.data), one
    example per row: a job's batch_size counts examples."""
    from tprt.train.data import prepare_data
    from tprt.train.preference import prepare_preferences

    hp = rec.hyperparameters
    held_out = data_dir / rec.validation_dataset if rec.validation_dataset else None
    if rec.objective == "dpo":  # one completion per row already; batch_size counts pairs
        return prepare_preferences(data_dir / rec.dataset, tokenizer, int(hp["max_seq_len"]), int(hp["seed"]),
                                   eval_data=held_out)
    return prepare_data(data_dir / rec.dataset, tokenizer, int(hp["max_seq_len"]), int(hp["seed"]),
                        eval_data=held_out, per_example=True)


# A job's LoRA adapts every linear layer, as hosted fine-tuning services do by default: attention
# alone (the CLI's default) learns the demo's answer only half-way at the same steps and rate, and
# degenerates into repetition.
JOB_LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def finetune_config(rec: JobRecord, model_dir: Path, data_dir: Path) -> Any:
    """The trainer's configuration for a stored job (outputs in --data-dir/jobs/<id>/)."""
    from tprt.lora.config import LoRASettings
    from tprt.train.dpo import DPOConfig
    from tprt.train.trainer import FinetuneConfig, OptimSettings

    hp = rec.hyperparameters
    lora = rec.method == "lora"
    start = data_dir / rec.init_adapter if rec.init_adapter else None
    targets: tuple[str, ...] = JOB_LORA_TARGETS
    if start is not None:  # the job was checked against it; its targets are the run's
        from tprt.errors import ConfigError
        from tprt.lora.peft_io import read_adapter_config, read_config_file

        targets = read_adapter_config(read_config_file(start, "adapter_config.json", ConfigError))[0]
    dpo = None if rec.objective != "dpo" else DPOConfig(
        beta=float(hp.get("beta", 0.1)), loss=str(hp.get("dpo_loss", "sigmoid")),
        label_smoothing=float(hp.get("label_smoothing", 0.0)),
        rpo_alpha=float(hp.get("rpo_alpha", 0.0)))  # 0 too for a DPO job stored before RPO existed
    return FinetuneConfig(
        model=Path(model_dir), data=data_dir / rec.dataset, out=data_dir / "jobs" / rec.id, full=not lora,
        lora=LoRASettings(rank=int(hp.get("lora_rank", 8)), alpha=float(hp.get("lora_alpha", 16.0)),
                          targets=targets, init=start),
        dpo=dpo, optim=OptimSettings(lr=float(hp["learning_rate"]), warmup_steps=int(hp["warmup_steps"]),
                                     weight_decay=float(hp["weight_decay"])),
        steps=int(hp["steps"]), batch_size=int(hp["batch_size"]), seq_len=int(hp["max_seq_len"]),
        save_every=0, seed=int(hp["seed"]), dtype="fp32", progress=False,  # LoRA: the served dtype (executor)
        eval_data=data_dir / rec.validation_dataset if rec.validation_dataset else None,
    )
