"""Thread set-up for CPU inference.

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

import torch

T = TypeVar("T")


def decode_threads() -> int:
    """Threads for the compiled decode kernels: this process's torch thread count."""
    return torch.get_num_threads()


def run_on_exiting_thread(fn: Callable[[], T]) -> T:
    """fn() on a new thread that exits when it returns (taking its OpenMP pool with it); its
    result or exception comes back to the caller."""
    with ThreadPoolExecutor(1, thread_name_prefix="tprt-setup") as pool:
        return pool.submit(fn).result()
