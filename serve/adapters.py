"""The LoRA adapters the server can apply, by id (ModelInfo lists them; requests name one)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AdapterInfo:
    id: str
    path: Path  # the exported adapter directory
    rank: int
    alpha: float
    source_job_id: str = ""
    index: int = 0  # where every rank holds it in the served model (tprt.lora.routing); requests route to it


class AdapterRegistry:
    """Thread-safe id -> adapter map on rank 0 (the ranks hold the weights; see serve/finetune.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, AdapterInfo] = {}

    def add(self, info: AdapterInfo) -> None:
        with self._lock:
            self._by_id[info.id] = info

    def has(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._by_id

    def get(self, adapter_id: str) -> AdapterInfo | None:
        with self._lock:
            return self._by_id.get(adapter_id)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda a: a.id)
