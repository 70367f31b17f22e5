"""The jobs core: fine-tuning jobs as every front end creates and reads them.

gRPC's FineTuning service (serve/grpc/handlers.py) and the OpenAI routes (serve/openai/app.py)
read their own wire shapes into a `JobRequest` (serve/jobs/request.py) and hand it here; one
instance per server holds what creating a job checks against (the tokenizer, the served context,
the adapters, the dataset size limit, the memory admission) and the job manager that stores and
runs them. Errors name the request's canonical fields (`dataset_path`, `hyperparameters.<name>`),
which each front end renames to its own spelling.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve.adapters.registry import AdapterRegistry
from serve.errors import Unavailable
from serve.jobs.manager import JobManager
from serve.jobs.request import JobRequest
from serve.jobs.spec import DEFAULT_MAX_DATASET_BYTES, JobSpec, check_create
from serve.jobs.store import JobRecord, JobStore

Admit = Callable[[str, dict[str, Any]], None]  # serve/jobs/admission.py: refuses a job too large for memory


class JobsCore:
    """Creating, reading and cancelling jobs, for every front end (see the module docstring)."""

    def __init__(self, manager: JobManager, tokenizer: Any, context_length: int, adapters: AdapterRegistry,
                 max_dataset_bytes: int = DEFAULT_MAX_DATASET_BYTES, admit: Admit | None = None) -> None:
        self.manager = manager
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.adapters = adapters
        self.max_dataset_bytes = max_dataset_bytes
        self.admit = admit

    @property
    def store(self) -> JobStore:
        return self.manager.store

    @property
    def data_dir(self) -> Path:
        return self.manager.data_dir

    def create(self, request: JobRequest, before_store: Callable[[JobSpec], None] | None = None) -> JobRecord:
        """Checks `request` (its dataset read and tokenized, its memory admitted) and queues the job;
        `before_store` writes what a front end keeps beside it into the job's directory first.
        UNAVAILABLE while the server drains."""
        if not self.manager.accepting:
            raise Unavailable(self.manager.refusal)
        spec = check_create(request, self.store, self.data_dir, self.tokenizer, self.context_length,
                            self.adapters.has, self.max_dataset_bytes, self.admit)
        if before_store is not None:
            before_store(spec)
        return self.manager.create(spec)

    def get(self, job_id: str) -> JobRecord:
        return self.manager.get(job_id)

    def shown(self, rec: JobRecord) -> JobRecord:
        """A record as callers see it (its error made safe to show)."""
        return self.manager.shown(rec)

    def cancel(self, job_id: str) -> JobRecord:
        return self.manager.cancel(job_id)

    @property
    def accepting(self) -> bool:
        return self.manager.accepting
