"""Multi-rank test harness: ONE gloo world per world size runs many named checks.

A check is a picklable callable `check(ctx: TPContext, workdir: Path) -> None` that raises
(usually AssertionError) on failure; every rank runs every check in order. The parent collects
per-check, per-rank pass/fail and the test functions assert one check each:

    WORLD2 = [("mlp_grads", check_mlp_grads), ...]

    @pytest.fixture(scope="module")
    def world2(workdir):
        return run_world(2, WORLD2, workdir)

    @pytest.mark.parametrize("name", names(WORLD2))
    def test_tp2(world2, name):
        world2.assert_ok(name)

It cannot hang: collectives time out (gloo timeout), the launcher has an overall deadline, and a
failing or dying rank tears the whole world down (tprt.distributed.launcher). Each rank appends its results
to a file as it goes, so checks finished before a teardown still report their own outcome.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext, init_distributed
from tprt.distributed.launcher import LaunchError, launch_local, one_line

Check = Callable[[TPContext, Path], None]

# Where the checks' models live: "cpu" (CI), or "cuda" (bench/gpu_check.sh): TP 1 on the GPU,
# and every rank of a larger world on the same GPU through gloo.
TEST_DEVICE = os.environ.get("TPRT_TEST_DEVICE", "cpu")
Checks = Sequence[tuple[str, Check]]


def names(checks: Checks) -> list[str]:
    return [name for name, _ in checks]


def _describe(e: BaseException) -> str:
    """One line: the error and the deepest frame in a test file."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/tests/" in f.filename]
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return one_line(e) + where


def run_one(ctx: TPContext, name: str, check: Check, workdir: Path) -> tuple[bool, str]:
    """Runs one check on this rank; (ok, one-line message)."""
    try:
        check(ctx, workdir)
        return True, ""
    except Exception as e:  # noqa: BLE001 - every failure is reported, never raised
        return False, _describe(e)


def _worker(checks: Checks, workdir: Path, results_dir: Path, collective_timeout_s: float) -> None:
    if TEST_DEVICE == "cpu":
        ctx = init_distributed(timeout_s=collective_timeout_s)
    else:
        ctx = init_distributed(timeout_s=collective_timeout_s, backend="gloo", device=TEST_DEVICE)
    torch.manual_seed(1234)
    out = results_dir / f"rank{ctx.rank}.jsonl"
    for name, check in checks:
        t0 = time.perf_counter()
        ok, msg = run_one(ctx, name, check, workdir)
        with out.open("a") as f:
            f.write(json.dumps({"name": name, "ok": ok, "msg": msg, "s": time.perf_counter() - t0}) + "\n")
        # Keeps checks from overlapping; if the ranks fell out of step inside the check this
        # times out and the world is torn down (the results above are already written).
        dist.barrier(group=ctx.group)


@dataclass
class WorldResults:
    """Outcome of every check in one world: merged over ranks."""

    world_size: int
    results: dict[str, tuple[bool, str]]  # name -> (ok on every rank, first failure message)
    seconds: dict[str, float]  # name -> slowest rank's time
    setup_error: str = ""  # why checks without a result did not run

    def __repr__(self) -> str:  # pytest prints fixtures' values on failure: keep it short
        failed = [n for n, (ok, _) in self.results.items() if not ok]
        return f"WorldResults(tp={self.world_size}, ran={len(self.results)}, failed={failed})"

    def assert_ok(self, name: str) -> None:
        if name not in self.results:
            raise AssertionError(f"check {name!r} did not run at TP={self.world_size}: {self.setup_error}")
        ok, msg = self.results[name]
        assert ok, f"TP={self.world_size} {name}: {msg}"


def run_world(
    world_size: int,
    checks: Checks,
    workdir: Path,
    timeout_s: float = 240.0,
    collective_timeout_s: float = 60.0,
) -> WorldResults:
    """Runs every check on every rank of one fresh gloo world of `world_size` processes."""
    results_dir = workdir / f"results-tp{world_size}-{time.monotonic_ns()}"
    results_dir.mkdir(parents=True)
    error = ""
    try:
        launch_local(
            world_size, _worker, (list(checks), workdir, results_dir, collective_timeout_s),
            timeout_s=timeout_s, threads_per_rank=1,
        )
    except LaunchError as e:
        error = str(e)
    return _merge(world_size, results_dir, error)


def _merge(world_size: int, results_dir: Path, error: str) -> WorldResults:
    per_rank: list[dict[str, dict[str, object]]] = []
    for r in range(world_size):
        path = results_dir / f"rank{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        per_rank.append({d["name"]: d for d in map(json.loads, lines)})
    results: dict[str, tuple[bool, str]] = {}
    seconds: dict[str, float] = {}
    for name in per_rank[0]:
        if not all(name in pr for pr in per_rank):
            continue
        fails = [f"rank {r}: {pr[name]['msg']}" for r, pr in enumerate(per_rank) if not pr[name]["ok"]]
        results[name] = (not fails, fails[0] if fails else "")
        seconds[name] = max(float(str(pr[name]["s"])) for pr in per_rank)
    return WorldResults(world_size, results, seconds, error or "the world ended before reaching it")


def run_single(checks: Checks, workdir: Path) -> WorldResults:
    """The same checks in this process at TP=1, with no process group, on one thread (tiny
    models on a shared machine: more threads only spin against other processes)."""
    ctx = TPContext.single(TEST_DEVICE)
    results: dict[str, tuple[bool, str]] = {}
    seconds: dict[str, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, check in checks:
            t0 = time.perf_counter()
            results[name] = run_one(ctx, name, check, workdir)
            seconds[name] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return WorldResults(1, results, seconds)
