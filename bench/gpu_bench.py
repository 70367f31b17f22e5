"""GPU decode benchmark: tokens/s against the HBM bandwidth floor (needs CUDA; not run in CI).

    python bench/gpu_bench.py --model /path/to/tp1-checkpoint                 # one GPU
    python bench/gpu_bench.py --random bench/configs/llama-3.1-8b/config.json # random 8B weights
    torchrun --nproc-per-node 2 bench/gpu_bench.py --model /path/to/tp2-ckpt  # TP over 2 GPUs (NCCL)

Per rank the weights are bf16 on cuda:LOCAL_RANK: loaded from a TP checkpoint, or with
`--random CONFIG` drawn on the GPU for that config.json's shapes (decode speed depends on the
shapes only; no checkpoint to write, read or convert). Reported on rank 0, for each of
`--batches` (1, 16, 64): decode tokens/s with CUDA graphs (tprt.engine.step_graphs) and
eagerly, the measured device-memory read bandwidth (a large tensor summed on the GPU) and the
floor, bandwidth / (weight bytes per rank per token), i.e. the rate if every decode step only
had to stream this rank's weights once. Decode rates are differences of two run lengths, so
prefill and start-up cancel out. `--out FILE` also writes the JSON there.
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

from tprt.distributed.context import TPContext, init_distributed, shutdown  # noqa: E402
from tprt.engine.core import Engine, EngineConfig, run_to_completion  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402
from tprt.model.config import ModelConfig, TPLayout  # noqa: E402
from tprt.model.llama import RMSNorm, TPLlamaForCausalLM  # noqa: E402


def random_model(config: Path, ctx: TPContext, dtype: torch.dtype = torch.bfloat16,
                 num_layers: int | None = None) -> TPLlamaForCausalLM:
    """This rank's shard of a model of `config`'s shapes (optionally only its first `num_layers`
    layers), weights drawn on the device as N(0, 0.02), norms 1: built on meta, then allocated
    on `ctx.device` directly (no host copy)."""
    cfg = ModelConfig.from_file(config)
    if num_layers is not None:
        cfg = ModelConfig.from_dict(dict(cfg.raw, num_hidden_layers=num_layers), source=str(config))
    return random_model_of(cfg, ctx, dtype)


def random_model_of(cfg: ModelConfig, ctx: TPContext, dtype: torch.dtype = torch.bfloat16) -> TPLlamaForCausalLM:
    """`random_model` for a config already read."""
    with torch.device("meta"):
        model = TPLlamaForCausalLM(cfg, TPLayout.for_model(cfg, ctx.world_size), ctx, dtype)
    model.to_empty(device=ctx.device)
    gen = torch.Generator(ctx.device).manual_seed(ctx.rank)
    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                if isinstance(module, RMSNorm):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    return model.requires_grad_(False).eval()


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
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="TP checkpoint (TP = number of GPUs)")
    source.add_argument("--random", type=Path, metavar="CONFIG", help="config.json: random bf16 weights of its shapes")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,16,64", help="comma-separated decode batch sizes")
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py: no CUDA device")
    ctx = init_distributed()
    if args.model:
        from tprt.checkpoint.loading import load_model  # numpy: not needed for --random

        model = load_model(args.model, ctx, "bf16")
    else:
        model = random_model(args.random, ctx)
    weight_bytes = sum(p.nbytes for p in model.parameters())
    if not model.config.tie_word_embeddings:
        weight_bytes -= model.embed_tokens.weight.nbytes  # looked up, not streamed
    bw = hbm_bandwidth(ctx.device)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(ctx.device), "tp": ctx.world_size,
                           "model": str(args.model or args.random), "hbm_GBps": bw / 1e9,
                           "weight_bytes_per_rank": weight_bytes, "floor_tokens_per_s": bw / weight_bytes}
    for graphs in (True, False):
        for batch in batches:
            cfg = EngineConfig(max_batch=batch, max_seq_len=64 + args.tokens, cuda_graphs="all" if graphs else "off")
            engine = Engine(model, None, cfg)
            if engine.is_driver:
                with engine:
                    out[f"{'graphs' if graphs else 'eager'}_b{batch}"] = decode_rate(engine, batch, args.tokens // 4,
                                                                                      args.tokens)
            else:
                engine.follow()
    if ctx.rank == 0:
        print(json.dumps(out, indent=1))
        if args.out:
            args.out.write_text(json.dumps(out, indent=1) + "\n")
        floor = out["floor_tokens_per_s"]
        for batch in batches:
            for mode in ("graphs", "eager"):
                rate = out[f"{mode}_b{batch}"]
                # Each step streams the weights once for the whole batch: compare per-step rates.
                print(f"{mode}_b{batch}: {rate:.0f} tok/s aggregate = {rate / batch / floor:.0%} of the HBM floor "
                      f"per step ({floor:.0f} steps/s at {bw / 1e9:.0f} GB/s)")
    shutdown()


if __name__ == "__main__":
    main()
