"""The LoRA adapters the server can apply, by id (ModelInfo and ListAdapters list them; requests name one).

The registry is rank 0's thread-safe catalogue: for each adapter its facts (path, rank, alpha,
targets), where it is (`tier`: on the device and routable, in host memory, or only on disk), the
index the ranks hold it under, whether it is pinned, how many requests it has served, and what is
using it now (requests in flight, rows in the engine). The pool (serve/adapters/pool.py) decides
the tiers; the ranks hold the weights (serve/ranks/executor.py).
"""

from __future__ import annotations

import builtins
import itertools
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DEVICE, HOST, DISK = "device", "host", "disk"  # tiers: routable; in host memory; only its files
TIERS = (DEVICE, HOST, DISK)


@dataclass(frozen=True)
class AdapterInfo:
    id: str
    path: Path  # the exported adapter directory
    rank: int
    alpha: float
    source_job_id: str = ""
    index: int = 0  # where every rank holds it in the served model (tprt.lora.routing); requests route to it
    targets: tuple[str, ...] = ()  # the projections it adapts
    tier: str = DEVICE
    pinned: bool = False  # never evicted from the device tier
    requests: int = 0  # requests that named it since it was registered


class AdapterRegistry:
    """Thread-safe id -> adapter map on rank 0 (the ranks hold the weights; see serve/ranks/executor.py)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._by_id: dict[str, AdapterInfo] = {}
        self._in_flight: dict[str, int] = {}  # requests submitted and not finished
        self._running: dict[str, int] = {}  # of those, admitted to the engine
        self._used: dict[str, int] = {}  # id -> tick of its last use (least recently used: smallest)
        self._unloading: set[str] = set()
        self._ticks = itertools.count(1)

    # ----------------------------------------------------------------- catalogue

    def add(self, info: AdapterInfo) -> None:
        """Registers (or replaces) an adapter as given."""
        with self._lock:
            self._by_id[info.id] = info
            self._used[info.id] = next(self._ticks)
            self._lock.notify_all()

    def add_new(self, info: AdapterInfo) -> bool:
        """Registers an adapter unless its id is registered already (False then)."""
        with self._lock:
            if info.id in self._by_id:
                return False
            self.add(info)
            return True

    def has(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._by_id

    def get(self, adapter_id: str) -> AdapterInfo | None:
        with self._lock:
            return self._by_id.get(adapter_id)

    def list(self) -> builtins.list[AdapterInfo]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda a: a.id)

    def update(self, adapter_id: str, **changes: Any) -> AdapterInfo:
        with self._lock:
            info = self._by_id[adapter_id] = replace(self._by_id[adapter_id], **changes)
            self._lock.notify_all()
            return info

    def remove(self, adapter_id: str) -> None:
        with self._lock:
            self._by_id.pop(adapter_id, None)
            self._used.pop(adapter_id, None)
            self._unloading.discard(adapter_id)
            self._lock.notify_all()

    def in_tier(self, tier: str) -> builtins.list[AdapterInfo]:
        """The adapters in `tier`, least recently used first."""
        with self._lock:
            return sorted((a for a in self._by_id.values() if a.tier == tier), key=lambda a: self._used[a.id])

    # ----------------------------------------------------------------- use

    def acquire(self, adapter_id: str) -> AdapterInfo | None:
        """A request names the adapter: counts it and marks it used. None when it is not
        registered or is being unloaded."""
        with self._lock:
            info = self._by_id.get(adapter_id)
            if info is None or adapter_id in self._unloading:
                return None
            info = self._by_id[adapter_id] = replace(info, requests=info.requests + 1)
            self._in_flight[adapter_id] = self._in_flight.get(adapter_id, 0) + 1
            self._used[adapter_id] = next(self._ticks)
            return info

    def start(self, adapter_id: str) -> None:
        """An acquired request joined the engine's batch."""
        with self._lock:
            self._running[adapter_id] = self._running.get(adapter_id, 0) + 1
            self._used[adapter_id] = next(self._ticks)

    def release(self, adapter_id: str, started: bool) -> None:
        """An acquired request ended (`started`: after joining the batch)."""
        with self._lock:
            for counts, applies in ((self._in_flight, True), (self._running, started)):
                if applies and counts.get(adapter_id, 0) > 0:
                    counts[adapter_id] -= 1
            self._lock.notify_all()

    def in_flight(self, adapter_id: str) -> int:
        with self._lock:
            return self._in_flight.get(adapter_id, 0)

    def running(self, adapter_id: str) -> int:
        with self._lock:
            return self._running.get(adapter_id, 0)

    # ----------------------------------------------------------------- unloading

    def mark_unloading(self, adapter_id: str) -> bool:
        """New requests for it are refused from now on; False when it is not registered."""
        with self._lock:
            if adapter_id not in self._by_id:
                return False
            self._unloading.add(adapter_id)
            return True

    def unloadable(self) -> builtins.list[AdapterInfo]:
        """Adapters being unloaded whose requests have all finished."""
        with self._lock:
            return [self._by_id[a] for a in sorted(self._unloading) if not self._in_flight.get(a, 0)]

    def wait_removed(self, adapter_id: str, timeout_s: float | None) -> bool:
        """Waits until the adapter is no longer registered; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: adapter_id not in self._by_id, timeout_s)
