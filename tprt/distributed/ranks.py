"""How the ranks of a TP group stay in step: rank 0 decides, every rank executes.

Rank 0 sends generation steps through its engine and everything else through `RankGroup`, from
one thread only, so messages never interleave (the messages: `tprt.distributed.protocol`).
Followers (TP ranks 1..N-1) spend their life in `follower_loop`: inside their engine's
`follow()` they execute step plans and wait through keepalives; a COMMAND brings them out to
execute it with rank 0, after which they follow again; EXIT ends the loop.

A command runs on every rank in the same order, and then the ranks exchange a one-line error or
None (`tprt.distributed.together.run_together`): if any rank failed, every rank knows it, its
executor drops what the command started (`abandon`), and `CommandFailed` is raised on every rank
(rank 0's caller handles it; a follower carries on). A rank that fails *inside* a collective
leaves its peers waiting until the collective timeout.

While idle, rank 0 sends a keepalive every few seconds (`RankGroup.keepalive`). On one rank
nothing is sent and a command simply runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from tprt.distributed.context import TPContext
from tprt.distributed.launcher import one_line
from tprt.distributed.protocol import Command, Tag, receive_command, send_command, send_signal
from tprt.distributed.together import PeerFailed, run_together
from tprt.errors import TprtError

log = logging.getLogger("tprt")

R = TypeVar("R")


class CommandFailed(TprtError):
    """A command failed on at least one rank; the message names the rank (unless 0) and its error."""


class CommandExecutor(Protocol):
    """One rank's side of the commands; every rank has one and runs the same commands in order."""

    def execute(self, cmd: Command[R]) -> R:
        """This rank's part of `cmd` (collectives inside are fine: every rank runs it)."""
        ...

    def abandon(self) -> None:
        """A command failed on some rank: drop whatever it started here."""
        ...


def run_command(cmd: Command[R], ctx: TPContext, executor: CommandExecutor) -> R:
    """Runs `cmd` here, then learns whether every rank succeeded (collective: `run_together` over
    the TP group). Raises CommandFailed on every rank when one failed, after `abandon`."""
    try:
        return run_together(lambda: executor.execute(cmd), f"command {type(cmd).__name__}", ctx)
    except PeerFailed as e:
        executor.abandon()
        raise CommandFailed(f"rank {e.rank}: {e.error}") from None
    except Exception as e:  # noqa: BLE001 - this rank's own failure, which every rank now knows
        log.debug("command %s failed on rank %d", type(cmd).__name__, ctx.rank, exc_info=True)
        executor.abandon()
        raise CommandFailed(one_line(e)) from e


class RankGroup:
    """Rank 0's handle on the TP group for everything but generation steps (the engine sends those)."""

    def __init__(self, ctx: TPContext, executor: CommandExecutor) -> None:
        self.ctx = ctx
        self._executor = executor
        self.last_collective = time.monotonic()
        # Why a command's collective failed (a rank died, a timeout): the group is unusable. A
        # command that failed on some rank (CommandFailed) leaves it usable.
        self.failed: str | None = None

    def run(self, cmd: Command[R]) -> R:
        """Every rank executes `cmd` (collective); returns rank 0's result, or raises CommandFailed."""
        try:
            send_command(cmd, self.ctx)
            result = run_command(cmd, self.ctx, self._executor)
        except CommandFailed:
            raise
        except BaseException as e:
            self.failed = one_line(e)
            raise
        self.last_collective = time.monotonic()
        return result

    def keepalive(self) -> None:
        """Tells followers waiting in a collective that rank 0 is alive."""
        try:
            send_signal(Tag.KEEPALIVE, self.ctx)
        except BaseException as e:
            self.failed = one_line(e)
            raise
        self.last_collective = time.monotonic()

    def stepped(self) -> None:
        """Notes that the engine just ran a step (itself a collective)."""
        self.last_collective = time.monotonic()

    def exit(self) -> None:
        """Releases the followers: `follower_loop` returns. Nothing may be sent after it."""
        send_signal(Tag.EXIT, self.ctx)
        self.last_collective = time.monotonic()


def follower_loop(follow: Callable[[], Tag], ctx: TPContext, executor: CommandExecutor) -> None:
    """A follower's life: `follow()` (the engine's: steps and keepalives) returns the tag of any
    other message; execute each command with rank 0; return at EXIT."""
    while (tag := follow()) is not Tag.EXIT:
        if tag is not Tag.COMMAND:
            raise RuntimeError(f"follow() returned at a {tag.name} message (expected a command or exit)")
        cmd: Command[object] = receive_command(ctx)
        try:
            run_command(cmd, ctx, executor)
        except CommandFailed:
            pass  # every rank knows, and rank 0 reports it
