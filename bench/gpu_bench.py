"""GPU decode benchmark: tokens/s against the HBM bandwidth floor (needs CUDA; not run in CI).

    python bench/gpu_bench.py --model /path/to/tp1-checkpoint                 # one GPU
    torchrun --nproc-per-node 2 bench/gpu_bench.py --model /path/to/tp2-ckpt  # TP over 2 GPUs (NCCL)

Per rank the weights are bf16 on cuda:LOCAL_RANK. Reported on rank 0, for batch 1 and batch 16:
decode tokens/s with CUDA graphs (tprt.engine.static_decode) and eagerly, the measured device-memory
read bandwidth (a large tensor summed on the GPU) and the floor, bandwidth / (weight bytes per
rank per token), i.e. the rate if every decode step only had to stream this rank's weights once.
Decode rates are differences of two run lengths, so prefill and start-up cancel out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tprt  # noqa: E402, F401 - before torch: its allocator setting applies to every peer alike
import torch  # noqa: E402

from tprt.distributed.context import init_distributed, shutdown  # noqa: E402
from tprt.engine.core import Engine, EngineConfig, run_to_completion  # noqa: E402
from tprt.checkpoint.loading import load_model  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402


def hbm_bandwidth(device: torch.device) -> float:
    """Bytes/s of summing a 2 GiB bf16 tensor, best of 10."""
    x = torch.ones(1024**3, dtype=torch.bfloat16, device=device)
    x.sum()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        x.sum()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def decode_rate(engine: Engine, batch: int, n1: int, n2: int) -> float:
    prompt = list(range(100, 132))

    def run(n: int) -> float:
        for i in range(batch):
            engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), str(i))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_to_completion(engine)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(n1)  # warm-up, captures the graphs
    t1 = min(run(n1) for _ in range(3))
    t2 = min(run(n2) for _ in range(3))
    return batch * (n2 - n1) / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="TP checkpoint (TP = number of GPUs)")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py: no CUDA device")
    ctx = init_distributed()
    model = load_model(args.model, ctx, "bf16")
    weight_bytes = sum(p.nbytes for p in model.parameters())
    if not model.config.tie_word_embeddings:
        weight_bytes -= model.embed_tokens.weight.nbytes
    bw = hbm_bandwidth(ctx.device)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(ctx.device), "tp": ctx.world_size,
                           "hbm_GBps": bw / 1e9, "weight_bytes_per_rank": weight_bytes,
                           "floor_tokens_per_s": bw / weight_bytes}
    for graphs in (True, False):
        for batch in (1, 16):
            cfg = EngineConfig(max_batch=batch, max_seq_len=64 + args.tokens, static_decode=graphs)
            engine = Engine(model, None, cfg)
            if engine.is_driver:
                with engine:
                    out[f"{'graphs' if graphs else 'eager'}_b{batch}"] = decode_rate(engine, batch, args.tokens // 4,
                                                                                      args.tokens)
            else:
                engine.follow()
    if ctx.rank == 0:
        print(json.dumps(out, indent=1))
        for key in ("graphs_b1", "eager_b1"):
            print(f"{key}: {out[key]:.0f} tok/s = {out[key] / out['floor_tokens_per_s']:.0%} of the HBM floor "
                  f"({out['floor_tokens_per_s']:.0f} tok/s at {bw / 1e9:.0f} GB/s)")
        print(f"graphs_b16: {out['graphs_b16']:.0f} tok/s aggregate ({out['graphs_b16'] / out['graphs_b1']:.1f}x batch 1)")
    shutdown()


if __name__ == "__main__":
    main()
