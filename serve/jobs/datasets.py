"""Reading and tokenizing uploaded datasets, on threads of their own.

An upload is checked line by line with the tokenizer (serve/openai/files.py), and creating a job
reads its file again: seconds of CPU for a large file. On the thread pool that tokenizes every
completion, 45 uploads at once made a 2-token chat wait minutes. `DatasetWork` runs them on
WORKERS threads of their own with at most WAITING more queued; past that a caller gets 429 at
once. At shutdown it refuses new work with 503 and lets what it took finish (the drain waits).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from serve.errors import QueueFull, Unavailable

T = TypeVar("T")

WORKERS = 2
WAITING = 8


class DatasetWork:
    """At most `workers` dataset checks at a time, `waiting` more queued (thread-safe)."""

    def __init__(self, workers: int = WORKERS, waiting: int = WAITING) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tprt-datasets")
        self.capacity = workers + waiting
        self._idle = threading.Condition()
        self._taken = 0
        self._accepting = True

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the pool; QueueFull when it is full, Unavailable once shutting down. A
        caller that goes away does not stop the work: it holds its place until it ends."""
        with self._idle:
            if not self._accepting:
                raise Unavailable("the server is shutting down: it takes no new uploads or jobs; retry on another "
                                  "replica")
            if self._taken >= self.capacity:
                raise QueueFull(f"too many dataset uploads and job creations in progress (at most {self.capacity}); "
                                "retry later")
            self._taken += 1
        future: Future[T] = self._pool.submit(fn, *args)
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    def _release(self, _: Future[Any]) -> None:
        with self._idle:
            self._taken -= 1
            self._idle.notify_all()

    @property
    def in_progress(self) -> int:
        with self._idle:
            return self._taken

    def stop_accepting(self) -> None:
        with self._idle:
            self._accepting = False

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until the work taken has ended (at most `timeout_s`); whether it has."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._taken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True
