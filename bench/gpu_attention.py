"""GPU attention benchmark of tprt's paged Triton kernel (needs CUDA and Triton; not run in CI).

    python bench/gpu_attention.py --out attention.json

Two measurements on one layer of a Llama-3-8B-shaped cache (32 query heads, 8 KV heads,
head_dim 128, blocks of 16 positions):

- decode: 64 sequences x 4,096 positions, one query token each, bf16 and int8 KV: the bytes of
  keys, values (and scales) read per second as a share of the device's copy bandwidth measured
  here (a large tensor cloned); goal at least 70%.
- prefill: a ragged batch of prompts (512 to 2,048 tokens, 16k tokens in all) attending causally
  through the paged cache, against torch's SDPA (flash) on the same tokens laid out densely per
  prompt; goal at least 0.8x SDPA's speed.

Each figure is the median of CUDA-event timings after a warm-up; blocks are scattered over the
pool, as a served cache's are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def timed(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of `fn` on the GPU (CUDA events), after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second the device copies (read + write) a 2 GiB tensor at."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    seconds = timed(lambda: x.clone(), repeats=10)
    return 2 * x.nbytes / seconds


def cache(positions: int, kv: str) -> tuple[Any, torch.Tensor]:
    """A one-layer KVCache holding `positions` random positions in scattered blocks, and the
    block order (a permutation of the pool)."""
    from tprt.model.kv_cache import KVCache, kv_cache_dtype, quantize

    n_blocks = positions // BLOCK + 1
    storage = kv_cache_dtype(kv) or torch.bfloat16
    c = KVCache(1, n_blocks, KV_HEADS, BLOCK, HEAD_DIM, storage, device="cuda", compute_dtype=torch.bfloat16)
    values = torch.randn(n_blocks, 2, KV_HEADS, BLOCK, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    if c.scales is not None:
        q, s = quantize(values, storage)
        c.kv[0].copy_(q)
        c.scales[0].copy_(s)
    else:
        c.kv[0].copy_(values)
    order = torch.randperm(n_blocks - 1, device="cuda") + 1  # block 0 is scratch
    return c, order


def decode(kv: str, rows: int = 64, context: int = 4096) -> dict[str, float]:
    from tprt.gpu.attention import splits_for
    from tprt.gpu.triton_attention import paged_attention

    c, order = cache(rows * context, kv)
    blocks = context // BLOCK
    tables = order[: rows * blocks].view(rows, blocks).to(torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    ints = {"device": "cuda", "dtype": torch.int32}
    query_starts, starts = torch.arange(rows + 1, **ints), torch.full((rows,), context - 1, **ints)
    lens = torch.ones(rows, **ints)
    scales = None if c.scales is None else c.scales[0]
    splits = splits_for(rows, KV_HEADS, blocks)
    seconds = timed(lambda: paged_attention(q, c.kv[0], tables, query_starts, starts, lens, 1, scales=scales,
                                            splits=splits))
    per_position = 2 * KV_HEADS * HEAD_DIM * c.kv.element_size() + (0 if scales is None else 2 * KV_HEADS * 2)
    read = rows * context * per_position
    return {"seconds": seconds, "bytes_read": read, "bytes_per_s": read / seconds, "splits": splits}


def prefill(lengths: tuple[int, ...] = (2048, 512, 1536, 1024, 2048, 768, 1280, 2048, 1792, 1536, 1024, 640)) -> dict[str, float]:
    import torch.nn.functional as F

    from tprt.gpu.triton_attention import paged_attention

    total = sum(lengths)
    c, order = cache(total + BLOCK * len(lengths), "bf16")
    tables, k_dense, v_dense, used = [], [], [], 0
    width = max(lengths) // BLOCK + 1
    for n in lengths:
        blocks = order[used : used + n // BLOCK + 1]
        used += len(blocks)
        tables.append(torch.cat((blocks, blocks.new_zeros(width - len(blocks)))))
        kv = c.kv[0][blocks].permute(1, 2, 0, 3, 4).reshape(2, KV_HEADS, -1, HEAD_DIM)[:, :, :n]
        k_dense.append(kv[0].repeat_interleave(HEADS // KV_HEADS, 0))
        v_dense.append(kv[1].repeat_interleave(HEADS // KV_HEADS, 0))
    table = torch.stack(tables).to(torch.int32)
    q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    ints = {"device": "cuda", "dtype": torch.int32}
    query_starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], **ints)
    starts, lens = torch.zeros(len(lengths), **ints), torch.tensor(lengths, **ints)
    ours = timed(lambda: paged_attention(q, c.kv[0], table, query_starts, starts, lens, max(lengths)))
    q_dense = [q[a:b].transpose(0, 1)[None] for a, b in zip(query_starts[:-1].tolist(), query_starts[1:].tolist())]

    def sdpa() -> None:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            for qd, kd, vd in zip(q_dense, k_dense, v_dense):
                F.scaled_dot_product_attention(qd, kd[None], vd[None], is_causal=True)

    theirs = timed(sdpa)
    return {"tokens": total, "seconds": ours, "sdpa_flash_seconds": theirs, "speed_vs_sdpa": theirs / ours}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attention.py: needs a CUDA device", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bandwidth}
    for kv in ("bf16", "int8"):
        d = decode(kv)
        d["share_of_copy_bandwidth"] = d["bytes_per_s"] / bandwidth
        result[f"decode_{kv}"] = d
    result["prefill"] = prefill()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
