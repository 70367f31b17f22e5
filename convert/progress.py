"""A byte-counting progress bar on stderr (tqdm), or nothing."""

from __future__ import annotations

import sys
from typing import Any
from types import TracebackType

from tqdm import tqdm


class Progress:
    """Counts output bytes; shows size, speed and time left when enabled."""

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

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
