"""The memory planner against the CUDA allocator (needs CUDA; not run in CI).

    python bench/gpu_memory.py [--config bench/configs/llama-3.1-8b/config.json]
                               [--max-batch 16] [--max-seq-len 2048] [--prompt 512] [--new 32]
                               [--train-seq 2048] [--out FILE]

Two workloads at TP 1, each on a fresh allocator peak, with random bf16 weights of the
config's shapes (bench/gpu_bench.py's `random_model`):

- serve: an Engine with `--max-batch` slots of `--max-seq-len` tokens runs `--max-batch`
  greedy requests of `--prompt` tokens and `--new` new tokens (CUDA graphs on);
- finetune: one LoRA step (rank 16, every projection) on 1 x `--train-seq` tokens.

For each it writes torch.cuda.max_memory_allocated, the weight and KV-cache bytes the process
holds, and the planner's predicted per-rank peak for the same workload, from
`tprt plan ... --json` (issue 14 part A: `planner_peak`). Where the planner cannot answer (not
merged yet, or a dependency missing on the machine) the result says why, in one line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tprt  # noqa: E402, F401 - before torch
import torch  # noqa: E402

from bench.gpu_bench import random_model  # noqa: E402
from tprt.distributed.context import TPContext  # noqa: E402
from tprt.engine.core import Engine, EngineConfig, run_to_completion  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402
from tprt.lora.attach import apply_lora  # noqa: E402
from tprt.lora.config import TARGETS  # noqa: E402
from tprt.train.optim import AdamW  # noqa: E402
from tprt.train.step import compute_loss  # noqa: E402


def planner_device(name: str) -> str:
    """`tprt plan --device` for a CUDA device name."""
    return "h200-141gb" if "H200" in name else "a100-80gb" if "A100" in name else "h100-80gb"


def planner_peak(config: Path, device: str, workload: list[str]) -> tuple[int | None, str]:
    """PLANNER HOOK: (the per-rank peak `tprt plan --json` predicts, "") or (None, why not).

    Runs the CLI the issue specifies, `tprt plan --model CONFIG --tp 1 --device D --json
    <workload...>`, and reads `peak_bytes_per_rank` from its JSON."""
    cmd = [sys.executable, "-m", "tprt.cli", "plan", "--model", str(config), "--tp", "1",
           "--device", device, "--json", *workload]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, f"`{' '.join(cmd[1:])}` failed: {lines[-1] if lines else proc.returncode}"
    try:
        return int(json.loads(proc.stdout)["peak_bytes_per_rank"]), ""
    except (ValueError, KeyError, TypeError) as e:
        return None, f"tprt plan --json gave no peak_bytes_per_rank ({e!r})"


def measure_serve(config: Path, ctx: TPContext, max_batch: int, max_seq_len: int, prompt: int,
                  new: int) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    model = random_model(config, ctx)
    engine = Engine(model, None, EngineConfig(max_batch=max_batch, max_seq_len=max_seq_len, cuda_graphs="all"))
    for i in range(max_batch):
        ids = [(i * 7919 + k) % model.config.vocab_size for k in range(prompt)]
        engine.add(ids, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True), str(i))
    run_to_completion(engine)
    torch.cuda.synchronize(ctx.device)
    out = {"max_memory_allocated": torch.cuda.max_memory_allocated(ctx.device),
           "weights_bytes": sum(p.nbytes for p in model.parameters()), "kv_cache_bytes": engine.runner.cache.nbytes()}
    engine.close()
    return out


def measure_lora_step(config: Path, ctx: TPContext, seq: int) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    model = random_model(config, ctx).train()
    params = apply_lora(model, TARGETS, rank=16, alpha=32.0)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=ctx.device)
    loss_sum, n_tokens = compute_loss(model, ids, ids)
    (loss_sum / n_tokens).backward()
    AdamW(params, lr=1e-4).step()
    torch.cuda.synchronize(ctx.device)
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(ctx.device),
            "weights_bytes": sum(p.nbytes for p in model.parameters())}


def compare(measured: dict[str, Any], predicted: int | None, why: str) -> dict[str, Any]:
    out = dict(measured, planner_peak_bytes=predicted)
    if predicted is None:
        out["planner"] = why
    else:
        out["planner_error"] = predicted / measured["max_memory_allocated"] - 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "bench" / "configs" / "llama-3.1-8b" / "config.json")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--train-seq", type=int, default=2048)
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_memory.py: no CUDA device")
    ctx = TPContext.single("cuda")
    name = torch.cuda.get_device_name(ctx.device)
    device = planner_device(name)
    serve = ["serve", "--dtype", "bf16", "--max-seq-len", str(args.max_seq_len), "--max-batch-size", str(args.max_batch)]
    finetune = ["finetune", "--lora-rank", "16", "--dtype", "bf16", "--batch-size", "1", "--seq-len", str(args.train_seq)]
    out: dict[str, Any] = {"device": name, "config": str(args.config)}
    out["serve"] = compare(measure_serve(args.config, ctx, args.max_batch, args.max_seq_len, args.prompt, args.new),
                           *planner_peak(args.config, device, serve))
    out["lora_step"] = compare(measure_lora_step(args.config, ctx, args.train_seq),
                               *planner_peak(args.config, device, finetune))
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
