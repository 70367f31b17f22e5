"""tprt.cpu.threads: set-up on a thread that exits leaves no OpenMP pool behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import os, threading, time, torch
from tprt.cpu.threads import run_on_exiting_thread
torch.set_num_threads(2)
def tasks(): return len(os.listdir("/proc/self/task"))
def parallel(): return (torch.randn(600, 600) @ torch.randn(600, 600)).sum().item()
before = tasks()
run_on_exiting_thread(parallel)
for _ in range(100):  # the pool's workers exit on their own, just after the thread
    if tasks() == before:
        break
    time.sleep(0.05)
after_helper = tasks()
parallel()
print(before, after_helper, tasks())
try:
    run_on_exiting_thread(lambda: 1 / 0)
except ZeroDivisionError:
    print("raised")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_setup_thread_takes_its_openmp_pool_with_it() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=True).stdout
    counts, raised = out.split("\n")[:2]
    before, after_helper, after_main = map(int, counts.split())
    assert after_helper == before, out  # the helper thread and its OpenMP worker are gone
    assert after_main > before, out  # the same region on this thread leaves a worker behind
    assert raised == "raised"
