"""tprt.v1.FineTuning's messages <-> the job side's own types: a CreateJobRequest as the neutral
JobRequest that `check_create` takes (serve/jobs/request.py), a stored JobRecord as a Job or
JobProgress message."""

from __future__ import annotations

from typing import Any

from serve.errors import InvalidArgument
from serve.grpc.pb import finetuning_pb2 as pb
from serve.jobs.request import JobRequest
from serve.jobs.store import JobRecord, now_ms

STATE_PB = {"queued": pb.JOB_STATE_QUEUED, "running": pb.JOB_STATE_RUNNING, "succeeded": pb.JOB_STATE_SUCCEEDED,
            "failed": pb.JOB_STATE_FAILED, "cancelled": pb.JOB_STATE_CANCELLED}
PB_STATE = {v: k for k, v in STATE_PB.items()}
METHOD_PB = {"lora": pb.METHOD_LORA, "full": pb.METHOD_FULL}
OBJECTIVE_PB = {"supervised": pb.OBJECTIVE_SUPERVISED, "dpo": pb.OBJECTIVE_DPO}
_HYPERPARAMETERS = tuple(f.name for f in pb.Hyperparameters.DESCRIPTOR.fields)


def job_request(request: Any) -> JobRequest:
    """A CreateJobRequest as a JobRequest: unspecified enums are the defaults (LoRA, supervised),
    and of the hyper-parameters only those set (proto3 `optional` presence) are passed on."""
    if request.method not in (pb.METHOD_UNSPECIFIED, *METHOD_PB.values()):
        raise InvalidArgument(f"unknown method {request.method}; METHOD_LORA or METHOD_FULL", "method")
    if request.objective not in (pb.OBJECTIVE_UNSPECIFIED, *OBJECTIVE_PB.values()):
        raise InvalidArgument(f"unknown objective {request.objective}; OBJECTIVE_SUPERVISED or OBJECTIVE_DPO",
                              "objective")
    hp = request.hyperparameters
    which = request.WhichOneof("dataset")
    return JobRequest(
        method="full" if request.method == pb.METHOD_FULL else "lora",
        objective="dpo" if request.objective == pb.OBJECTIVE_DPO else "supervised",
        hyperparameters={name: getattr(hp, name) for name in _HYPERPARAMETERS if hp.HasField(name)},
        dataset_path=request.dataset_path if which == "dataset_path" else None,
        inline_jsonl=request.inline_jsonl if which == "inline_jsonl" else None,
        validation_dataset_path=request.validation_dataset_path, adapter_id=request.adapter_id,
        init_adapter=request.init_adapter)


def job_pb(rec: JobRecord) -> Any:
    """The stored job as a Job message."""
    hp = pb.Hyperparameters(**rec.hyperparameters)
    return pb.Job(id=rec.id, state=STATE_PB[rec.state], method=METHOD_PB.get(rec.method, pb.METHOD_LORA),
                  objective=OBJECTIVE_PB.get(rec.objective, pb.OBJECTIVE_SUPERVISED), init_adapter=rec.init_adapter,
                  adapter_id=rec.adapter_id, dataset=rec.dataset, hyperparameters=hp,
                  created_unix_ms=rec.created_ms, started_unix_ms=rec.started_ms, finished_unix_ms=rec.finished_ms,
                  step=rec.step, total_steps=rec.total_steps, loss=rec.loss, tokens_per_second=rec.tokens_per_second,
                  error=rec.error, output_path=rec.output_path, validation_dataset=rec.validation_dataset,
                  eval_loss=rec.eval_loss, trained_tokens=rec.trained_tokens)


def progress_pb(rec: JobRecord) -> Any:
    """The stored job's progress as a JobProgress message (WatchJob)."""
    return pb.JobProgress(job_id=rec.id, state=STATE_PB[rec.state], step=rec.step, total_steps=rec.total_steps,
                          loss=rec.loss, tokens_per_second=rec.tokens_per_second, error=rec.error,
                          time_unix_ms=now_ms())
