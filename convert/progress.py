"""A byte-counting progress bar on stderr (tqdm), or nothing."""

from __future__ import annotations

import sys
from typing import Any
from types import TracebackType

from tqdm import tqdm


class Progress:
    """Counts bytes written (and downloaded, for a Hub source); shows size, speed and time left when enabled."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self._bar: tqdm[Any] | None = None
        if enabled:
            self._bar = tqdm(
                total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, dynamic_ncols=True, smoothing=0.1,
            )

    def update(self, nbytes: int) -> None:
        if self._bar is not None and nbytes:
            self._bar.update(nbytes)

    def grow(self, nbytes: int) -> None:
        """Adds `nbytes` of work (downloads) to the total."""
        if self._bar is not None and nbytes:
            self._bar.total = (self._bar.total or 0) + nbytes
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
