"""How the serving ranks stay in step: rank 0 decides, every rank executes.

Followers (TP ranks 1..N-1) spend their life in `follower_loop`: inside `Engine.follow()` they
execute rank 0's generation step plans; a *stop* plan brings them out to receive one `Command`
(broadcast from rank 0), which they execute, and then they go back to following plans. Commands
carry everything that is not a generation step: a fine-tuning step, loading an adapter, exit.
Rank 0 issues them with `RankGroup.run(command)` from the scheduler thread only (the one thread
that talks to the followers), so plans and commands never interleave.

While idle, rank 0 broadcasts an empty plan every few seconds (`keepalive`): a follower never
waits in a collective for long, so the collective timeout can stay short and a dead rank 0 is
noticed. On one rank nothing is broadcast.

`start_local_followers` starts ranks 1..N-1 on this machine with the environment torchrun would
give them (this process is rank 0); `watch` reports the first one that dies.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tprt.distributed.context import TPContext
from tprt.engine.plan import StepPlan, broadcast_plan

log = logging.getLogger("tprt.serve")


@dataclass(frozen=True)
class Command:
    """One non-generation action every rank performs together (picklable plain data)."""

    kind: str  # "exit", or a name registered with the executor (e.g. "train_step", "load_adapter")
    args: dict[str, Any] = field(default_factory=dict)


Executor = Callable[[Command], Any]  # runs a command on this rank; the same on every rank


def _broadcast_command(cmd: Command | None, ctx: TPContext) -> Command:
    box: list[Any] = [cmd]
    device = ctx.device if ctx.backend == "nccl" else None
    dist.broadcast_object_list(box, group=ctx.group, group_src=0, device=device)
    out = box[0]
    assert isinstance(out, Command)
    return out


class RankGroup:
    """Rank 0's handle on the TP group: generation steps go through the engine, the rest here."""

    def __init__(self, ctx: TPContext, execute: Executor) -> None:
        self.ctx = ctx
        self._execute = execute
        self.last_collective = time.monotonic()

    def run(self, cmd: Command) -> Any:
        """Every rank executes `cmd` (collective); returns rank 0's result."""
        if self.ctx.world_size > 1:
            broadcast_plan(StepPlan(stop=True), self.ctx)  # followers leave Engine.follow()
            _broadcast_command(cmd, self.ctx)
        result = self._execute(cmd) if cmd.kind != "exit" else None
        self.last_collective = time.monotonic()
        return result

    def keepalive(self) -> None:
        """An empty plan, so followers waiting in a collective hear from rank 0."""
        if self.ctx.world_size > 1:
            broadcast_plan(StepPlan(), self.ctx)
        self.last_collective = time.monotonic()

    def stepped(self) -> None:
        """Notes that the engine just ran a step (itself a collective)."""
        self.last_collective = time.monotonic()


def follower_loop(follow: Callable[[], None], ctx: TPContext, execute: Executor) -> None:
    """A follower's life: follow plans; between them, execute rank 0's commands; until "exit"."""
    while True:
        follow()
        cmd = _broadcast_command(None, ctx)
        if cmd.kind == "exit":
            return
        execute(cmd)


# ----------------------------------------------------------------- local ranks


def _follower_main(rank: int, world: int, port: int, threads: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Shutdown is rank 0's decision (it drains, then releases the followers): a terminal's Ctrl-C
    # or a SIGTERM sent to the whole process group must not kill a follower mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    torch.set_num_threads(threads)
    fn(*args)


def start_local_followers(world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...],
                          threads: int) -> list[Any]:
    """Starts ranks 1..world-1 running `fn(*args)`; this process becomes rank 0 (sets its env)."""
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mpctx: Any
    if "forkserver" in mp.get_all_start_methods():
        mpctx = mp.get_context("forkserver")
        mpctx.set_forkserver_preload(["torch", "torch.distributed"])
    else:
        mpctx = mp.get_context("spawn")
    procs = []
    for r in range(1, world):
        p = mpctx.Process(target=_follower_main, args=(r, world, port, threads, fn, args),
                          name=f"tprt-serve-rank{r}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def watch(procs: list[Any], on_death: Callable[[str], None], stop: threading.Event, poll_s: float = 0.2) -> threading.Thread:
    """A daemon thread that calls `on_death(reason)` once when a follower process exits early."""

    def run() -> None:
        while not stop.wait(poll_s):
            for rank, p in enumerate(procs, start=1):
                if p.exitcode is not None:
                    on_death(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
                    return

    t = threading.Thread(target=run, name="tprt-rank-watch", daemon=True)
    t.start()
    return t


def stop_followers(procs: list[Any], grace_s: float = 10.0) -> None:
    """Waits for followers to exit (they do after the "exit" command), then kills stragglers."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
