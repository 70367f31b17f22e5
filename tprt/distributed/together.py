"""Sections every rank runs and all of them finish together, failed or not: the one "run on every
rank, then exchange errors" helper (rank commands use it too: `tprt.distributed.ranks.run_command`).

A rank that fails alone (a directory rank 0 cannot create, a full disk, an adapter file one rank
cannot read) must not go on to the next collective while its peers wait in this one: the world
would hang until the collective timeout, and a server's ranks would be broken by one fine-tuning
job's fault. `run_together` runs this rank's part, then every rank learns whether any failed (one
all-gather of a line of text) and all of them raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from tprt.distributed.context import TPContext
from tprt.distributed.launcher import one_line
from tprt.errors import TprtError

T = TypeVar("T")


class PeerFailed(TprtError):
    """Another rank failed in a section this rank finished: `rank` (in the group the section ran
    over) and its one-line `error`."""

    def __init__(self, what: str, rank: int, error: str) -> None:
        super().__init__(f"{what} failed on rank {rank}: {error}")
        self.rank = rank
        self.error = error


def run_together(section: Callable[[], T], what: str, ctx: TPContext | None = None) -> T:
    """This rank's `section()`, after which every rank knows whether any failed; collective over
    the TP group of `ctx`, or over the world when `ctx` is None. Raises this rank's own error, or
    PeerFailed naming `what` and the first failing rank."""
    error: Exception | None = None
    value: Any = None
    try:
        value = section()
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
        error = e
    if ctx is not None:
        group, size = ctx.group, ctx.world_size
    else:
        group, size = None, dist.get_world_size() if dist.is_initialized() else 1
    if size > 1:
        errors: list[Any] = [None] * size
        dist.all_gather_object(errors, None if error is None else one_line(error), group=group)
        failed = [(rank, msg) for rank, msg in enumerate(errors) if msg is not None]
        if error is None and failed:
            raise PeerFailed(what, *failed[0])
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]
