"""A fine-tuning job as either front end asks for it: what `check_create` (serve/jobs/spec.py)
checks, with no protocol's types. The gRPC handler maps its CreateJobRequest onto it
(serve/grpc/jobs.py), the OpenAI routes a `POST /v1/fine_tuning/jobs` body (serve/openai/jobs.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

METHODS = ("lora", "full")
OBJECTIVES = ("supervised", "dpo")


@dataclass(frozen=True)
class JobRequest:
    """Errors about it name the gRPC fields (`dataset_path`, `hyperparameters.<name>`, ...); the
    OpenAI routes rename them (serve/openai/jobs.py)."""

    method: str = "lora"  # METHODS
    objective: str = "supervised"  # OBJECTIVES
    # Only those the caller set, by the proto's Hyperparameters field names (the rest get defaults).
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    dataset_path: str | None = None  # under --data-dir; at most one of the two is set
    inline_jsonl: str | None = None  # the JSONL itself, written into the job's directory
    validation_dataset_path: str = ""  # "": none
    adapter_id: str = ""  # "": the job id
    init_adapter: str = ""  # "": a new adapter
