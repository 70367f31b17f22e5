"""Fine-tuning MFU on one GPU: a stack of Llama-3.1-70B-shaped layers (needs CUDA; not run in CI).

    python bench/gpu_mfu.py [--config bench/configs/llama-3.1-70b/config.json] [--layers 4]
                            [--full-layers 1] [--batch 1] [--seq 4096] [--steps 4]
                            [--methods lora,full] [--peak-tflops auto] [--out FILE]

A 70B model does not fit one GPU, but its layers are what each step spends its time in: this
builds the real model class with the config's shapes and only `--layers` decoder layers (the
embedding and LM head are the real ones), random bf16 weights on the GPU, and times the real
training step (tprt.train.step.compute_loss with the vocab-parallel loss, backward, AdamW with
fp32 moments and masters) at TP 1:

- lora: rank 16 on q,k,v,o,gate,up,down, base frozen;
- full: the decoder layers trained (`--full-layers` of them: AdamW state is 16 bytes a
  parameter), embedding and LM head frozen.

Model FLOPs per step (what MFU counts; recomputation and the optimizer are not credited):
forward 2*T*(layer matmul parameters) + 2*T*seq*q_size per layer (causal attention: QK^T and
PV over half the keys) + 2*T*vocab*hidden (LM head), T = batch*seq tokens. The backward repeats
each matmul for the input gradient (x1) and, where the weight trains, for the weight gradient
(x1 more); attention's backward is twice its forward. MFU = FLOPs / time / peak, with peak the
dense bf16 tensor rate of the device (H100/H200 SXM 989 TFLOPS, H100 PCIe 756, A100 312;
`--peak-tflops` for others). Also reported: torch.cuda.max_memory_allocated per method.
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

import tprt  # noqa: E402, F401 - before torch
import torch  # noqa: E402

from bench.gpu_bench import random_model  # noqa: E402
from tprt.distributed.context import TPContext  # noqa: E402
from tprt.lora.attach import apply_lora  # noqa: E402
from tprt.lora.config import TARGETS  # noqa: E402
from tprt.model.config import ModelConfig  # noqa: E402
from tprt.train.optim import AdamW  # noqa: E402
from tprt.train.step import compute_loss  # noqa: E402

PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0))


def peak_tflops(name: str) -> float | None:
    """The dense bf16 tensor-core peak of a device, from its name; None when unknown."""
    return next((tf for key, tf in PEAK_TFLOPS if key in name), None)


def step_flops(cfg: ModelConfig, layers: int, batch: int, seq: int, method: str) -> float:
    """Model FLOPs of one training step (see the module docstring)."""
    tokens = batch * seq
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    layer_params = (q + 2 * kv) * h + h * q + 3 * cfg.intermediate_size * h
    linear = 2 * tokens * layers * layer_params
    attention = 2 * tokens * seq * q * layers
    head = 2 * tokens * cfg.vocab_size * h
    linear_passes = 3 if method == "full" else 2  # forward, input gradient, weight gradient (full only)
    return linear * linear_passes + attention * 3 + head * 2


def time_method(config: Path, ctx: TPContext, method: str, layers: int, batch: int, seq: int,
                steps: int) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    model = random_model(config, ctx, torch.bfloat16, num_layers=layers).train()
    if method == "lora":
        params = apply_lora(model, TARGETS, rank=16, alpha=32.0)
    else:
        params = [p for layer in model.layers for p in layer.parameters()]
        for p in params:
            p.requires_grad_(True)
    optimizer = AdamW(params, lr=1e-5)
    gen = torch.Generator(ctx.device).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=ctx.device, generator=gen)

    def step() -> None:
        loss_sum, n_tokens = compute_loss(model, ids, ids)
        (loss_sum / n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: allocator, kernels, optimizer state
        step()
    torch.cuda.synchronize(ctx.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(ctx.device)
    seconds = (time.perf_counter() - t0) / steps
    flops = step_flops(model.config, layers, batch, seq, method)
    out = {"layers": layers, "batch": batch, "seq": seq, "step_s": seconds, "tflops": flops / seconds / 1e12,
           "max_memory_allocated": torch.cuda.max_memory_allocated(ctx.device)}
    del model, optimizer, params
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "bench" / "configs" / "llama-3.1-70b" / "config.json")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers for LoRA")
    ap.add_argument("--full-layers", type=int, default=1, help="decoder layers for full fine-tuning")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from its name)")
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    args = ap.parse_args()
    methods = args.methods.split(",")
    if unknown := set(methods) - {"lora", "full"}:
        ap.error(f"--methods: unknown {sorted(unknown)}; expected lora and/or full")
    if not torch.cuda.is_available():
        sys.exit("gpu_mfu.py: no CUDA device")
    ctx = TPContext.single("cuda")
    name = torch.cuda.get_device_name(ctx.device)
    peak = args.peak_tflops or peak_tflops(name)
    if peak is None:
        sys.exit(f"gpu_mfu.py: unknown peak for {name!r}; pass --peak-tflops")
    out: dict[str, Any] = {"device": name, "peak_tflops": peak, "config": str(args.config)}
    for method in methods:
        layers = args.layers if method == "lora" else args.full_layers
        result = time_method(args.config, ctx, method, layers, args.batch, args.seq, args.steps)
        result["mfu"] = result["tflops"] / peak
        out[method] = result
        print(f"{method}: {layers} layers, {args.batch}x{args.seq} tokens: {result['step_s'] * 1e3:.0f} ms/step, "
              f"{result['tflops']:.0f} TFLOPS = {result['mfu']:.0%} MFU, "
              f"peak {result['max_memory_allocated'] / 2**30:.1f} GiB", flush=True)
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
