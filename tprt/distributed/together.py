"""Sections every rank runs and all of them finish together, failed or not.

A rank that fails alone (a directory rank 0 cannot create, a full disk) must not go on to the
next collective while its peers wait in this one: the world would hang until the collective
timeout, and a server's ranks would be broken by one fine-tuning job's fault. `run_together`
runs this rank's part, then every rank learns whether any failed (one all-gather of a line of
text over the world) and all of them raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from tprt.errors import TprtError

T = TypeVar("T")


class PeerFailed(TprtError):
    """Another rank failed in a section this rank finished."""


def run_together(section: Callable[[], T], what: str) -> T:
    """This rank's `section()`, after which every rank knows whether any failed; collective over
    the world. Raises this rank's own error, or PeerFailed naming `what` and the failing rank."""
    error: Exception | None = None
    value: Any = None
    try:
        value = section()
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
        error = e
    if dist.is_initialized():
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        failed = [(rank, msg) for rank, msg in enumerate(errors) if msg is not None]
        if error is None and failed:
            raise PeerFailed(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]
