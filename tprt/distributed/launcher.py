"""tprt's own local launcher: N ranks on this machine without torchrun, in two modes.

`launch_local(n, fn, args)` spawns n processes with the environment torchrun would give them
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), runs `fn(*args)` in
each and returns the ranks' return values in rank order. If any rank raises or dies, the others
are terminated at once (a rank stuck in a collective would otherwise wait for its peer forever)
and `LaunchError` carries the failing rank's one-line error.

`start_followers(n, fn, args)` makes this process rank 0 and starts ranks 1..n-1 running
`fn(*args)` (the server: rank 0 keeps its own life); they ignore SIGINT/SIGTERM, since stopping
is rank 0's decision. `watch` reports the first one that dies, `stop_followers` reaps them.

`run_on_ranks(model, fn, args)` is what a command calls: under torchrun, `fn` runs on the ranks
torchrun started; otherwise on the checkpoint's TP number of local ranks.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from tprt.checkpoint.format import MANIFEST_NAME, TPCheckpoint
from tprt.distributed.context import in_distributed_env, shutdown
from tprt.errors import ConfigError, TprtError

_POLL_S = 0.05
_GRACE_S = 5.0

T = TypeVar("T")


class LaunchError(TprtError):
    """A rank failed (raised, died or timed out); the message names the rank and its error."""

    def __init__(self, message: str, rank: int | None = None, details: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.details = details  # the failing rank's full traceback, when there is one


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_line(e: BaseException) -> str:
    """`Type: message` on one line (the message's first line; tprt errors show the message alone)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, TprtError):
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _set_rank_env(rank: int, world: int, port: int) -> None:
    """torchrun's environment for local rank `rank` (what `init_distributed` reads)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _mp_context() -> Any:
    """forkserver where available: one server process imports torch once and every rank is a
    fork of it (starting N ranks costs one torch import, not N). spawn elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


# ----------------------------------------------------------------- every rank local: launch_local


def _rank_main(
    rank: int,
    nprocs: int,
    port: int,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    _set_rank_env(rank, nprocs, port)
    torch.set_num_threads(threads)
    try:
        value = fn(*args)
        results.put(("ok", rank, value, ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        results.put(("error", rank, one_line(e), traceback.format_exc()))
    finally:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - peers may be gone already
            pass


def _stop_all(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch_local(
    nprocs: int,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    timeout_s: float | None = None,
    threads_per_rank: int | None = None,
) -> list[Any]:
    """Runs `fn(*args)` on `nprocs` local ranks and returns their results in rank order.

    `fn` must be picklable (a module-level function) and joins the world itself, typically via
    `tprt.distributed.context.init_distributed()`. Raises `LaunchError` naming the first rank that failed;
    every other rank is terminated before it returns, so nothing is left running.
    """
    if nprocs < 1:
        raise LaunchError(f"--nprocs must be at least 1, got {nprocs}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs)
    ctx = _mp_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, nprocs, port, threads, fn, tuple(args), results), name=f"tprt-rank{r}")
        for r in range(nprocs)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, timeout_s)
    finally:
        _stop_all(procs)
        results.close()


def _collect(procs: Sequence[Any], results: Any, timeout_s: float | None) -> list[Any]:
    """Waits for every rank's result; raises on the first failure, death or the deadline."""
    n = len(procs)
    values: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(values) < n:
        try:
            status, rank, value, details = results.get(timeout=_POLL_S)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
            if dead:
                _drain(results, values)  # a result or error sent just before exiting may still be in flight
                dead = [r for r in dead if r not in values]
            if dead:
                r = dead[0]
                raise LaunchError(f"rank {r} exited with code {procs[r].exitcode} without a result", rank=r)
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(n)) - set(values))
                raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for ranks {missing}") from None
            continue
        if status == "error":
            raise LaunchError(f"rank {rank} failed: {value}", rank=rank, details=details)
        values[rank] = value
    return [values[r] for r in range(n)]


def _drain(results: Any, values: dict[int, Any]) -> None:
    """Reads what is already queued; raises for an error among it."""
    try:
        while True:
            status, rank, value, details = results.get(timeout=0.5)
            if status == "error":
                raise LaunchError(f"rank {rank} failed: {value}", rank=rank, details=details)
            values[rank] = value
    except queue.Empty:
        return


# ----------------------------------------------------------------- this process is rank 0: start_followers


def _follower_main(rank: int, world: int, port: int, threads: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    _set_rank_env(rank, world, port)
    # Stopping is rank 0's decision (a server drains, then releases the followers): a terminal's
    # Ctrl-C or a SIGTERM sent to the whole process group must not kill a follower mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    fn(*args)


def start_followers(world: int, fn: Callable[..., None], args: tuple[Any, ...], threads: int) -> list[Any]:
    """Starts ranks 1..world-1 running `fn(*args)` with `threads` torch threads each; this process
    becomes rank 0 (its environment is set for `init_distributed`)."""
    port = free_port()
    _set_rank_env(0, world, port)
    ctx = _mp_context()
    procs = []
    for r in range(1, world):
        p = ctx.Process(target=_follower_main, args=(r, world, port, threads, fn, args), name=f"tprt-rank{r}",
                        daemon=True)
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
    """Waits up to `grace_s` for followers to exit (they do once released), then kills stragglers."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


# ----------------------------------------------------------------- torchrun or local: run_on_ranks


def run_on_ranks(model: str | Path, fn: Callable[..., T], args: Sequence[Any] = (), *, threads: int | None = None,
                 dp: bool = False, tp1_in_process: bool = False, pp: int = 1) -> T:
    """Runs `fn(*args)` on every rank of the world that serves the TP checkpoint `model`.

    Under torchrun (or inside a launched rank): here, on this rank, leaving the world afterwards;
    returns this rank's result. The world must be the checkpoint's TP size, or with `dp` any
    world the ranks can lay out as dp x tp (`init_distributed(tp_size=...)` checks it).
    Otherwise: on the checkpoint's TP number of local ranks (`launch_local`; in this process when
    TP is 1 and `tp1_in_process`); returns rank 0's result. `pp`: pipeline stages of TP ranks
    each (the world is TP x PP ranks). `threads`: torch threads per rank
    (None: local ranks share the cores, torchrun's ranks and this process keep their own count).
    """
    ranks = TPCheckpoint(model).tp_size * pp
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {threads}")
    local = not in_distributed_env()
    in_process = not local or (ranks == 1 and tp1_in_process)
    if threads is not None and in_process:
        torch.set_num_threads(threads)
    if not local:
        world = int(os.environ["WORLD_SIZE"])
        if not dp and world != ranks:
            layout = f"tp_size={ranks // pp}" + (f", by --pp {pp} stages ({ranks} ranks)" if pp > 1 else "")
            raise ConfigError(f"{Path(model) / MANIFEST_NAME}: the checkpoint is sharded for {layout} but "
                              f"torchrun started WORLD_SIZE={world} ranks; start {ranks} (e.g. --nproc-per-node {ranks})")
        try:
            return fn(*args)
        finally:
            shutdown()
    if in_process:
        return fn(*args)
    results: list[T] = launch_local(ranks, fn, args, threads_per_rank=threads)
    return results[0]
