"""tprt.distributed.shm_allreduce: a peer dying mid-collective, or never arriving, ends the wait
with an error, never a hang. (Its results against gloo's: tests/test_model_tp.py, every TP world.)"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tprt.distributed import shm_allreduce
from tprt.distributed.shm_allreduce import ShmAllReduce

SLOT = 4096  # small slots: the 1000-value tensors below go through in chunks


def _rank(path: str, rank: int, pids: Any, out: Any) -> None:
    """Sums 50 times; rank 2 leaves without a word after 3 sums (a crash)."""
    pids[rank] = os.getpid()
    while any(p == 0 for p in pids):  # every rank's pid is known (as the launcher's gather does)
        time.sleep(0.001)
    shm = ShmAllReduce(path, rank, 3, 600.0, list(pids), slot_bytes=SLOT)
    x = torch.ones(1000)
    try:
        for i in range(50):
            if rank == 2 and i == 3:
                os._exit(3)
            shm.all_reduce(x.fill_(rank + 1))
            assert torch.equal(x, torch.full((1000,), 6.0))
    except RuntimeError as e:
        out.put((rank, str(e), time.monotonic()))
        return
    out.put((rank, "finished", time.monotonic()))


def test_a_rank_killed_mid_collective_ends_the_others_with_an_error() -> None:
    path = ShmAllReduce.create_segment(3, SLOT)
    if shm_allreduce._library() is None:  # without a C compiler: refused (for_group then keeps gloo)
        with pytest.raises(RuntimeError, match="C library is unavailable"):
            ShmAllReduce(path, 0, 3, 1.0, [0, 0, 0])
        return
    mp = multiprocessing.get_context("fork")
    pids, out = mp.Array("q", 3), mp.Queue()
    procs = [mp.Process(target=_rank, args=(path, r, pids, out)) for r in range(3)]
    try:
        start = time.monotonic()
        for p in procs:
            p.start()
        got = sorted(out.get(timeout=60) for _ in range(2))  # the survivors
        for rank, message, when in got:
            assert f"TP rank 2 (pid {pids[2]}) exited mid-collective; rank {rank} stops too" in message, message
            assert when - start < 10  # seconds, although the collective's timeout is 600 s
        assert [r for r, _, _ in got] == [0, 1]
        for p in procs:
            p.join(10)
        assert [p.exitcode for p in procs] == [0, 0, 3]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        Path(path).unlink()


def test_a_peer_that_never_arrives_times_out() -> None:
    path = ShmAllReduce.create_segment(2, SLOT)
    try:
        me = os.getpid()
        first, _second = ShmAllReduce(path, 0, 2, 0.3, [me, me], SLOT), ShmAllReduce(path, 1, 2, 0.3, [me, me], SLOT)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"no answer from every TP rank within 0.3 s \(rank 0\)"):
            first.all_reduce(torch.ones(10))
        assert 0.3 <= time.monotonic() - t0 < 5
    finally:
        Path(path).unlink()


def _join_group(store_path: str, rank: int, hide_peers: bool, out: Any) -> None:
    """Joins a 2-rank gloo world and reports whether for_group attached; `hide_peers`: this rank
    cannot see the other's process (as in a container with its own pid namespace)."""
    import torch.distributed as dist

    if hide_peers:
        shm_allreduce._sees = lambda pid: pid == os.getpid()  # type: ignore[assignment]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        shm = shm_allreduce.for_group(dist.group.WORLD, rank, 2, 30.0)
        if shm is not None:
            shm.all_reduce(x := torch.full((3,), float(rank + 1)))
            out.put((rank, x.tolist()))
        else:
            out.put((rank, None))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hidden", [None, 1])
def test_for_group_attaches_every_rank_or_none(tmp_path: Path, hidden: int | None) -> None:
    """Every rank of the group gets the segment, or (one rank unable to see its peers) none does,
    and the group keeps gloo; nothing is left in /dev/shm either way."""
    attaches = hidden is None and shm_allreduce._library() is not None  # no C compiler: gloo throughout
    before = set(shm_allreduce.SHM_DIR.glob("tprt-allreduce-*"))
    mp = multiprocessing.get_context("fork")
    out = mp.Queue()
    procs = [mp.Process(target=_join_group, args=(str(tmp_path / "store"), r, r == hidden, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=60) for _ in range(2))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got == ({0: [3.0] * 3, 1: [3.0] * 3} if attaches else {0: None, 1: None})
    assert set(shm_allreduce.SHM_DIR.glob("tprt-allreduce-*")) == before
