"""OpenAI fine-tuning jobs <-> tprt's jobs (the same JobManager and SQLite store as gRPC).

A `POST /v1/fine_tuning/jobs` body becomes the same JobRequest (serve/jobs/request.py) a gRPC
CreateJob becomes, checked by the same `check_create`: `training_file` is the uploaded file's path under --data-dir
(serve/openai/files.py), `method.type` is "supervised" or "dpo" (preference pairs; LoRA unless
the extra field `full: true` asks for a full fine-tune; `model` naming a served adapter starts from
it, e.g. DPO after SFT), and the hyper-parameters map as follows (DPO's `beta` as OpenAI's, our
`dpo_loss`, `label_smoothing` and `rpo_alpha` as extras):

    n_epochs                   passes over the examples: steps = ceil(n_epochs x examples / batch_size)
                               ("auto": 3, more for a small file, fewer for a large one: `auto_epochs`)
    batch_size                 examples per optimizer step, each example its own row ("auto": `auto_batch_size`)
    learning_rate_multiplier   learning_rate = multiplier x our default (1e-3 LoRA, 1e-5 full)  ("auto": 1)
    seed (top level)           seed
    suffix                     the adapter id, `<suffix>-<6 hex digits>` (`fine_tuned_model`)
    metadata                   kept as given: at most 16 pairs, keys of 64 and values of 512 characters

and our own settings go in the same hyperparameters object as extras: steps (instead of
n_epochs), learning_rate, max_seq_len, lora_rank, lora_alpha, weight_decay, warmup_steps,
checkpoint_every. Every value is range-checked before the file is counted (400 naming it).
What the job store does not keep (the epochs chosen, the suffix, metadata) is a small JSON file
in the job's directory; a job created over gRPC has none and shows its dataset path as
`training_file`. `trained_tokens` counts the tokens of every step's examples (padding left out).

Ids: our job `job-<hex>` is OpenAI's `ftjob-<hex>` (either is accepted). Statuses are ours
(queued, running, succeeded, failed, cancelled): files are checked at upload and at creation,
so a job never waits in `validating_files`. Events are derived from the record and the job's
per-step metrics log; the one checkpoint listed is a succeeded job's output.
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from serve.errors import InvalidArgument, NotFound, ServeError, echo
from serve.jobs.request import JobRequest
from serve.jobs.spec import ADAPTER_ID, checked_value, default_of
from serve.jobs.store import FAILED, SUCCEEDED, JobRecord
from serve.openai.files import file_of_dataset
from serve.openai.requests import ParamError, renamed
from tprt.checkpoint.fsutil import write_bytes_atomic
from tprt.train.dpo_advice import unmoved_warning

SIDECAR = "openai.json"
METRICS_LOG = "metrics.jsonl"  # written by the trainer in the job's directory (tprt.train.plot)
_SUFFIX_CHARS = 40  # plus "-" and 6 hex digits: within an adapter id's 64
MAX_EPOCHS = 50  # OpenAI's range for n_epochs is [1, 50]
# OpenAI's metadata limits: 16 pairs, keys of at most 64 characters, values of at most 512.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
# "auto" n_epochs as OpenAI picks it from the file's size: 3 epochs, raised so that a small file
# gets about 100 examples' worth of steps (at most 25 epochs), lowered so that a large one gets
# about 25,000 (at least 1).
_TARGET_EPOCHS, _MIN_TARGET_EXAMPLES, _MAX_TARGET_EXAMPLES, _MAX_AUTO_EPOCHS = 3, 100, 25_000, 25

Auto = Literal["auto"]


class Hyperparameters(BaseModel):
    """OpenAI's supervised hyper-parameters, and ours (serve/jobs/spec.py) as extras."""

    model_config = ConfigDict(extra="forbid")  # a misspelled setting is an error, not a default

    n_epochs: int | Auto | None = None
    batch_size: int | Auto | None = None
    learning_rate_multiplier: float | Auto | None = None
    steps: int | None = None
    learning_rate: float | None = None
    max_seq_len: int | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    checkpoint_every: int | None = None
    beta: float | Auto | None = None  # method "dpo" ("auto": 0.1), as OpenAI's; the next three ours
    dpo_loss: str | None = None
    label_smoothing: float | None = None
    rpo_alpha: float | None = None


class Supervised(BaseModel):
    hyperparameters: Hyperparameters | None = None


class Method(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    supervised: Supervised | None = None
    dpo: Supervised | None = None  # the same shape: {"hyperparameters": {...}}


class FineTuningJobBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = None
    seed: int | None = None
    hyperparameters: Hyperparameters | None = None  # OpenAI's older spelling of method.supervised's
    method: Method | None = None
    integrations: list[Any] | None = None
    metadata: dict[str, str] | None = None  # checked by check_metadata (OpenAI's limits)
    full: bool = False  # ours: every weight instead of LoRA; the result is a checkpoint to serve, not an adapter


def auto_epochs(examples: int) -> int:
    """OpenAI's documented default for n_epochs: 3, or enough for ~100 examples seen (at most 25),
    or few enough for ~25,000 (at least 1)."""
    if examples * _TARGET_EPOCHS < _MIN_TARGET_EXAMPLES:
        return min(_MAX_AUTO_EPOCHS, _MIN_TARGET_EXAMPLES // examples)
    if examples * _TARGET_EPOCHS > _MAX_TARGET_EXAMPLES:
        return max(1, _MAX_TARGET_EXAMPLES // examples)
    return _TARGET_EPOCHS


def auto_batch_size(examples: int) -> int:
    """OpenAI's documented default batch size: about 0.2% of the examples, at least 1, at most 256."""
    return max(1, min(256, round(examples * 0.002)))


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits on a job's metadata: 16 pairs, 64-character keys, 512-character values."""
    if metadata is None:
        return
    if len(metadata) > METADATA_PAIRS:
        raise ParamError(f"at most {METADATA_PAIRS} key-value pairs, got {len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ParamError(f"keys are at most {METADATA_KEY_CHARS} characters, got one of {len(key)}", "metadata")
        if len(value) > METADATA_VALUE_CHARS:
            raise ParamError(f"values are at most {METADATA_VALUE_CHARS} characters, got one of {len(value)} "
                             f"(key {echo(key[:METADATA_KEY_CHARS])})", f"metadata.{key}")


def openai_job_id(job_id: str) -> str:
    return "ft" + job_id if job_id.startswith("job-") else job_id


def store_job_id(given: str) -> str:
    return given[2:] if given.startswith("ftjob-") else given


class OpenAIJob:
    """A checked-as-far-as-OpenAI-goes job body: the hyper-parameters it sets (our names), the
    parameter prefix they came under, and what the job store will not keep. `fit(examples)`
    settles what depends on the training file (auto batch size, epochs -> steps); `request(...)` is
    the JobRequest for `check_create`."""

    def __init__(self, body: FineTuningJobBody) -> None:
        self.body = body
        hp, self.hp_param = _chosen_hyperparameters(body)
        self.hp = hp
        self.objective = body.method.type if body.method is not None else "supervised"
        if body.integrations:
            raise ParamError("not supported by this server", "integrations")
        check_metadata(body.metadata)
        self.method = "full" if body.full else "lora"
        self.adapter_id = ""
        if body.suffix is not None:
            if body.full:
                raise ParamError("a full fine-tune produces a checkpoint, not a model served by name", "suffix")
            self.adapter_id = f"{body.suffix}-{secrets.token_hex(3)}"
            if len(body.suffix) > _SUFFIX_CHARS or not ADAPTER_ID.fullmatch(self.adapter_id):
                raise ParamError(f"1-{_SUFFIX_CHARS} characters: letters, digits, '.', '_', '-' (starting with a "
                                 "letter or digit)", "suffix")
        given = {name: getattr(hp, name) for name in ("steps", "learning_rate", "max_seq_len", "lora_rank",
                                                      "lora_alpha", "weight_decay", "warmup_steps", "checkpoint_every")}
        if isinstance(hp.batch_size, int):
            given["batch_size"] = hp.batch_size
        if isinstance(hp.learning_rate_multiplier, float | int):
            if hp.learning_rate is not None:
                raise ParamError("give learning_rate_multiplier or learning_rate, not both",
                                 f"{self.hp_param}.learning_rate")
            base_rate = default_of("learning_rate", self.method)
            most = 1.0 / base_rate  # our learning rates are in (0, 1]
            if not 0 < hp.learning_rate_multiplier <= most:  # NaN and inf too
                raise ParamError(f"must be in (0, {most:g}] (times {base_rate:g}), got {hp.learning_rate_multiplier}",
                                 f"{self.hp_param}.learning_rate_multiplier")
            given["learning_rate"] = hp.learning_rate_multiplier * base_rate
        if isinstance(hp.n_epochs, int) and hp.steps is not None:
            raise ParamError("give n_epochs or steps, not both", f"{self.hp_param}.steps")
        self.epochs = hp.n_epochs if isinstance(hp.n_epochs, int) else None
        if self.epochs is not None and not 1 <= self.epochs <= MAX_EPOCHS:
            raise ParamError(f"must be in [1, {MAX_EPOCHS}], got {str(self.epochs)[:40]}", f"{self.hp_param}.n_epochs")
        given = {k: v for k, v in given.items() if v is not None}
        try:  # in our ranges now: `fit` computes with batch_size, and seed's error names the top-level field
            given = {k: checked_value(k, v) for k, v in given.items()}
            seed = None if body.seed is None else checked_value("seed", body.seed)
        except InvalidArgument as e:
            raise renamed(e, {"hyperparameters.seed": "seed", "hyperparameters": self.hp_param}) from None
        if seed is not None:
            given["seed"] = seed
        dpo = {name: getattr(hp, name) for name in ("beta", "dpo_loss", "label_smoothing", "rpo_alpha")}
        dpo = {k: v for k, v in dpo.items() if v is not None and v != "auto"}
        if self.objective != "dpo" and dpo:
            raise ParamError("applies to method 'dpo' only", f"{self.hp_param}.{next(iter(dpo))}")
        for name in ("beta", "label_smoothing", "rpo_alpha"):
            if name in dpo and not math.isfinite(dpo[name]):
                raise ParamError(f"must be a finite number, got {dpo[name]}", f"{self.hp_param}.{name}")
        self.hyperparameters: dict[str, Any] = {**given, **dpo}  # those set, by the names check_create reads

    def fit(self, examples: int) -> None:
        """The batch size (auto: from the number of examples) and, unless `steps` was given, the
        steps of n_epochs (auto: from the number of examples) passes over the examples."""
        hp = self.hyperparameters
        batch_size = hp.setdefault("batch_size", auto_batch_size(examples))
        if "steps" not in hp:
            self.epochs = self.epochs or auto_epochs(examples)
            steps = max(1, math.ceil(self.epochs * examples / batch_size))
            if steps > 1_000_000:
                raise ParamError(f"{self.epochs} epochs of {examples} examples at batch size {batch_size} are "
                                 f"{steps} steps, more than 1000000", f"{self.hp_param}.n_epochs")
            hp["steps"] = steps

    def request(self, dataset_path: str, validation_dataset_path: str, init_adapter: str) -> JobRequest:
        """The job as `check_create` takes it (after `fit`)."""
        return JobRequest(method=self.method, objective=self.objective, hyperparameters=dict(self.hyperparameters),
                          dataset_path=dataset_path, validation_dataset_path=validation_dataset_path,
                          adapter_id=self.adapter_id, init_adapter=init_adapter)

    def error(self, e: ServeError) -> ParamError:
        """A check_create error with its field as this body spells it."""
        return renamed(e, {"hyperparameters": self.hp_param, "dataset_path": "training_file",
                           "dataset": "training_file", "adapter_id": "suffix", "init_adapter": "model",
                           "validation_dataset_path": "validation_file"})

    def sidecar(self) -> dict[str, Any]:
        hp = self.hp
        return {"n_epochs": self.epochs, "batch_size": hp.batch_size,
                "learning_rate_multiplier": hp.learning_rate_multiplier, "suffix": self.body.suffix,
                "metadata": self.body.metadata}


def _chosen_hyperparameters(body: FineTuningJobBody) -> tuple[Hyperparameters, str]:
    method = body.method
    if method is not None and method.type not in ("supervised", "dpo"):
        raise ParamError(f"{echo(method.type)}; this server fine-tunes with 'supervised' or 'dpo'", "method.type")
    kind = method.type if method is not None else "supervised"
    other = "dpo" if kind == "supervised" else "supervised"
    if method is not None and getattr(method, other) is not None:  # it would be ignored
        raise ParamError(f"given with method.type {kind!r}; its hyperparameters go in method.{kind}", f"method.{other}")
    inner = getattr(method, kind) if method is not None else None
    nested = inner.hyperparameters if inner is not None else None
    if nested is not None and body.hyperparameters is not None:
        raise ParamError(f"give method.{kind}.hyperparameters or hyperparameters, not both", "hyperparameters")
    if nested is not None:
        return nested, f"method.{kind}.hyperparameters"
    return body.hyperparameters or Hyperparameters(), "hyperparameters"


# ----------------------------------------------------------------- the job's directory


def write_sidecar(data_dir: Path, rec: JobRecord, values: dict[str, Any]) -> None:
    job_dir = data_dir / "jobs" / rec.id
    job_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(job_dir / SIDECAR, json.dumps(values).encode())


def read_sidecar(data_dir: Path, rec: JobRecord) -> dict[str, Any]:
    try:
        return dict(json.loads((data_dir / "jobs" / rec.id / SIDECAR).read_text()))
    except FileNotFoundError:  # created over gRPC
        return {}


def _step_records(data_dir: Path, rec: JobRecord) -> list[dict[str, Any]]:
    """The job's per-step metrics; the line being appended right now, if any, is left out."""
    try:
        lines = (data_dir / "jobs" / rec.id / METRICS_LOG).read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


# ----------------------------------------------------------------- OpenAI objects


def _seconds(ms: int) -> int | None:
    return ms // 1000 if ms else None


def job_object(rec: JobRecord, base_model: str, data_dir: Path) -> dict[str, Any]:
    """The stored job as OpenAI's `fine_tuning.job`, with our own fields under `tprt`."""
    side = read_sidecar(data_dir, rec)
    hp = rec.hyperparameters
    lr_default = default_of("learning_rate", rec.method)
    hyper = {"n_epochs": side.get("n_epochs") or "auto", "batch_size": hp.get("batch_size"),
             "learning_rate_multiplier": float(hp.get("learning_rate", lr_default)) / lr_default}
    succeeded = rec.state == SUCCEEDED
    return {
        "object": "fine_tuning.job", "id": openai_job_id(rec.id), "model": base_model,
        "created_at": rec.created_ms // 1000, "finished_at": _seconds(rec.finished_ms),
        "fine_tuned_model": rec.adapter_id if succeeded and rec.method == "lora" else None,
        "organization_id": "tprt", "result_files": [], "status": rec.state,
        "training_file": file_of_dataset(rec.dataset) or rec.dataset,
        "validation_file": file_of_dataset(rec.validation_dataset) or rec.validation_dataset or None,
        "hyperparameters": hyper, "trained_tokens": rec.trained_tokens if succeeded else None,
        "error": {"code": "job_failed", "message": rec.error, "param": None} if rec.state == FAILED else None,
        "seed": int(hp.get("seed", 0)), "estimated_finish": None, "integrations": [],
        "user_provided_suffix": side.get("suffix"), "metadata": side.get("metadata"),
        "method": _method(rec, hyper),
        "tprt": {"job_id": rec.id, "method": rec.method, "step": rec.step, "total_steps": rec.total_steps,
                 "init_adapter": rec.init_adapter or None,
                 "trained_tokens": rec.trained_tokens,
                 "loss": rec.loss, "eval_loss": rec.eval_loss, "output_path": rec.output_path,
                 "hyperparameters": hp},
    }


def _method(rec: JobRecord, hyper: dict[str, Any]) -> dict[str, Any]:
    if rec.objective != "dpo":
        return {"type": "supervised", "supervised": {"hyperparameters": hyper}}
    hp = rec.hyperparameters
    return {"type": "dpo", "dpo": {"hyperparameters": {**hyper, "beta": hp.get("beta"), "dpo_loss": hp.get("dpo_loss"),
                                                       "label_smoothing": hp.get("label_smoothing"),
                                                       # 0: a job stored before RPO existed ran without it
                                                       "rpo_alpha": hp.get("rpo_alpha", 0.0)}}}


# a DPO step's metrics, as its events carry them (tprt.train.dpo)
_PREFERENCE_KEYS = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "eval_rewards_chosen",
                    "eval_rewards_rejected", "eval_reward_accuracy", "eval_reward_margin")


def job_events(rec: JobRecord, data_dir: Path) -> list[dict[str, Any]]:
    """The job's events, oldest first: created, started, one per optimizer step, and how it ended."""
    started = rec.started_ms or rec.created_ms
    raw: list[tuple[int, str, str, dict[str, Any] | None]] = [(rec.created_ms, "info", "Created fine-tuning job", None)]
    if rec.started_ms:
        raw.append((rec.started_ms, "info", "Fine-tuning job started", None))
    records = _step_records(data_dir, rec)
    for r in records:
        data = {"step": r.get("step"), "total_steps": rec.total_steps, "train_loss": r.get("loss"),
                "learning_rate": r.get("lr"), "tokens_per_second": r.get("tokens_per_s")}
        message = f"Step {r.get('step')}/{rec.total_steps}: training loss={r.get('loss')}"
        if r.get("eval_loss") is not None:  # over the whole validation file, as OpenAI's full_valid_loss
            data["full_valid_loss"] = r["eval_loss"]
            message += f", validation loss={r['eval_loss']}"
        data.update({k: r[k] for k in _PREFERENCE_KEYS if r.get(k) is not None})
        if r.get("reward_accuracy") is not None:
            message += f", reward accuracy={r['reward_accuracy']}"
        if r.get("eval_reward_accuracy") is not None:
            message += f", validation reward accuracy={r['eval_reward_accuracy']}"
        raw.append((int(r.get("time_unix_ms", started)), "info", message, data))
    preference = [r for r in records if r.get("reward_accuracy") is not None]
    warning = unmoved_warning(preference[-1]) if preference else None  # DPO "worked", the model did not move
    if warning:
        raw.append((int(preference[-1].get("time_unix_ms", started)), "warn", warning[0].upper() + warning[1:], None))
    if rec.state == SUCCEEDED:
        raw.append((rec.finished_ms, "info", "The job has successfully completed", None))
    elif rec.state == FAILED:
        raw.append((rec.finished_ms, "error", f"The job failed: {rec.error}", None))
    elif rec.state == "cancelled":
        raw.append((rec.finished_ms, "info", "The job was cancelled", None))
    elif rec.error:  # queued again after a shutdown or a broken world
        raw.append((rec.finished_ms or started, "warn", rec.error, None))
    hexid = rec.id.removeprefix("job-")
    return [{"object": "fine_tuning.job.event", "id": f"ftevent-{hexid}-{i}", "created_at": ms // 1000,
             "level": level, "message": message, "data": data, "type": "metrics" if data else "message"}
            for i, (ms, level, message, data) in enumerate(raw)]


def job_checkpoints(rec: JobRecord) -> list[dict[str, Any]]:
    """A succeeded job's output: its adapter (served by that name) or, for a full fine-tune, the
    checkpoint directory under --data-dir (served with `tprt serve --model`)."""
    if rec.state != SUCCEEDED:
        return []
    name = rec.adapter_id if rec.method == "lora" else rec.output_path
    return [{"object": "fine_tuning.job.checkpoint", "id": "ftckpt-" + rec.id.removeprefix("job-"),
             "created_at": rec.finished_ms // 1000, "fine_tuned_model_checkpoint": name,
             "fine_tuning_job_id": openai_job_id(rec.id), "step_number": rec.step,
             "metrics": {"step": rec.step, "train_loss": rec.loss,
                         **({} if rec.eval_loss is None else {"full_valid_loss": rec.eval_loss})}}]


def page(items: list[dict[str, Any]], after: str | None, limit: int, what: str) -> dict[str, Any]:
    """OpenAI's list page of `items` (newest first): those after the item `after`, at most `limit`."""
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise NotFound(f"no {what} {echo(after)}", "after")
        start = ids.index(after) + 1
    data = items[start:start + limit]
    return {"object": "list", "data": data, "has_more": start + limit < len(items)}
