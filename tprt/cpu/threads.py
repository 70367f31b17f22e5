"""Thread set-up for CPU inference.

`spare_cores(device)`: how many threads beside the forward pass have a core of their own (what a
launcher tells the engine for constrained rows' masks, `EngineConfig.mask_threads`).

`decode_threads()`: how many threads tprt's compiled decode kernels (`tprt.cpu.native`) share
their work among: the torch threads this process was given (tprt's launcher gives each rank
cores / TP, `--threads` overrides it; torch's default is every core).

Keeping torch's OpenMP workers fast when the model runs on a thread other than the main one:

libgomp (torch's OpenMP runtime on Linux) keeps a pool of worker threads for each thread that
has run a parallel region, until that thread exits. When the pools together hold more threads
than there are cores, every worker stops spinning between parallel regions and sleeps at once,
so each op pays a futex wake-up: on 2 cores a small parallel op went from ~19 to 70-90 us when
the main thread had loaded the model (one pool) and a scheduler thread ran it (a second pool).
A server therefore loads on a thread that ends before its scheduler thread starts.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import os

import torch

T = TypeVar("T")
MAX_SPARE_THREADS = 8  # threads given to work beside the forward pass, at most


def spare_cores(device: torch.device) -> int:
    """Threads beside the forward pass with a core of their own: on a GPU the host's cores (up
    to MAX_SPARE_THREADS); on the CPU those the kernels of all this host's ranks
    (LOCAL_WORLD_SIZE, as torchrun and tprt's launcher set it) leave. Call after the thread
    counts are set (the kernels' pool: tprt.cpu.native.threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if device.type != "cpu":
        return min(cores, MAX_SPARE_THREADS)
    from tprt.cpu import native

    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    local_ranks = max(1, int(local)) if local.isdigit() else 1
    spare = cores - max(torch.get_num_threads(), native.threads()) * local_ranks
    return min(max(spare, 0), MAX_SPARE_THREADS)


def decode_threads() -> int:
    """Threads for the compiled decode kernels: this process's torch thread count."""
    return torch.get_num_threads()


def run_on_exiting_thread(fn: Callable[[], T]) -> T:
    """fn() on a new thread that exits when it returns (taking its OpenMP pool with it); its
    result or exception comes back to the caller."""
    with ThreadPoolExecutor(1, thread_name_prefix="tprt-setup") as pool:
        return pool.submit(fn).result()
