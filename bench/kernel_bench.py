"""One-row matrix-vector products (batch-1 decode) on SmolLM2-135M's weight shapes: GB/s of tprt's
native GEMV (tprt.cpu.native) against torch's one-row kernels, on ordinary and on huge pages, next
to the read bandwidth of a plain sum on the same pages.

    python bench/kernel_bench.py                 # bf16 and fp32, 1 thread
    python bench/kernel_bench.py --repeats 5
    python bench/kernel_bench.py --threads 2     # torch and the native pool on 2 threads

Every candidate streams all 30 layers' q/k/v, o, gate/up and down weights plus the LM head once
per pass (weights allocated as the model's are: one tensor each on ordinary pages, one block
on huge pages), so the timing reads from memory as decode does; best of --repeats passes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# torch's allocator on ordinary pages, so that the "4 KiB pages" rows are; the huge-page rows
# advise their one block themselves (tprt.cpu.hugepages).
os.environ["THP_MEM_ALLOC_ENABLE"] = "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tprt.cpu import native  # noqa: E402
from tprt.cpu.fast_linear import PACK_ROWS_HINT  # noqa: E402
from tprt.cpu.hugepages import huge_empty, huge_tensors  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down
SHAPES = LAYER_SHAPES * 30 + [(49152, 576)]  # + the tied LM head


def best_pass(fns: list[Callable[[], object]], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        best = min(best, time.perf_counter() - t0)
    return best


def sum_bandwidth(huge: bool, repeats: int) -> float:
    n = 512 * 1024 * 1024
    x = (huge_empty(n).view(torch.float32) if huge else torch.empty(n // 4)).fill_(1.0)
    return n / best_pass([x.sum], repeats) / 1e9


def run(dtype: torch.dtype, huge: bool, repeats: int) -> dict[str, float]:
    if huge:
        weights = huge_tensors(SHAPES, dtype)
    else:
        weights = [torch.empty(shape, dtype=dtype) for shape in SHAPES]
    for w in weights:
        w.normal_()
    xs = {k: torch.randn(1, k).to(dtype) for k in {s[1] for s in SHAPES}}
    total = sum(w.nbytes for w in weights)
    out: dict[str, float] = {}
    candidates: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor] | None]] = {
        "native": native.gemv_kernel,
        "oneDNN packed": lambda w: (lambda p: lambda x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))(
            torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)),
        "F.linear": lambda w: lambda x: F.linear(x, w),
    }
    for name, make in candidates.items():
        fns = [make(w) for w in weights]
        if any(f is None for f in fns):
            continue
        calls = [(lambda f=f, x=xs[w.shape[1]]: f(x)) for f, w in zip(fns, weights)]  # type: ignore[misc]
        out[name] = total / best_pass(calls, repeats) / 1e9
        del fns, calls
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)  # the native GEMV's own pool: the same thread count as torch's
    if not native.available():
        print("note: tprt's native kernels are unavailable here (no C compiler?); torch's only", file=sys.stderr)
    for huge in (False, True):
        pages = "huge pages" if huge else "4 KiB pages"
        print(f"{pages}: plain sum {sum_bandwidth(huge, args.repeats):.1f} GB/s")
        for dtype in (torch.bfloat16, torch.float32):
            res = run(dtype, huge, args.repeats)
            print(f"  {str(dtype).removeprefix('torch.'):9s} " + "  ".join(f"{k} {v:.1f} GB/s" for k, v in res.items()),
                  flush=True)


if __name__ == "__main__":
    main()
