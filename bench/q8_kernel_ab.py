"""The int8 products (`tprt.cpu.native.q8_kernel`) of this checkout against another build of
kernels.c, in one process: milliseconds per product on SmolLM2's shapes (groups of 32, as a Q8_0
import stores them), and whether the two give the same bits.

    git show REV:tprt/cpu/native/kernels.c > /tmp/kernels_before.c
    python bench/q8_kernel_ab.py --against /tmp/kernels_before.c
    python bench/q8_kernel_ab.py --against /tmp/kernels_before.c --rows 9 16 32 --threads 2

Each figure is the median of --calls calls, best of two rounds alternated between the builds, so
other load on the machine falls on both alike; compare the ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tprt.cpu import native  # noqa: E402
from tprt.quant.formats import QuantSpec, quantize  # noqa: E402

SHAPES = [(1536, 576), (576, 1536), (960, 576), (49152, 576)]  # gate/up halves, down, qkv, the LM head


def median_ms(f: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[calls // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="another kernels.c to build and compare with")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9, 16, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--group", type=int, default=32, help="weight group size (32)")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    new = native._library()
    old = native.compile_library(args.against, "the other kernels.c")
    if new is None or old is None:
        sys.exit("q8_kernel_ab: needs a C compiler to build both kernels.c")
    native.bind_q8(old)
    for threads in args.threads:
        for lib in (old, new):
            lib.tprt_pool_set_threads(threads)
        native.set_threads(threads)
        torch.set_num_threads(threads)
        for n, k in SHAPES:
            q, s = quantize(torch.randn(n, k), QuantSpec("int8", args.group))
            before, after = native.q8_kernel(q, s, lib=old), native.q8_kernel(q, s, lib=new)
            assert before is not None and after is not None
            for rows in args.rows:
                x = torch.randn(rows, k).to(torch.bfloat16)
                a = min(median_ms(lambda: before(x), args.calls) for _ in range(2))
                b = min(median_ms(lambda: after(x), args.calls) for _ in range(2))
                same = torch.equal(before(x), after(x))
                print(f"{threads} thread(s) {n} x {k}, {rows:2d} bf16 rows: other {a:.4f} ms, this {b:.4f} ms "
                      f"({a / b:.2f}x), same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
