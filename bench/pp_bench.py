"""The pipeline's bubble: 1F1B training steps against the (p - 1) / (m + p - 1) model (issue 44).

    python bench/pp_bench.py [--pp 2] [--micro 2,4,8] [--seq 256] [--repeats 5]

A random Llama (hidden 512, 8 layers, fp32) in --pp stages of TP 1, one rank per stage on this
machine, trains batches of m rows of --seq tokens in m micro-batches (one row each) on torch's
1F1B schedule (tprt.train.pipeline). For each m: the step time T (median of --repeats), the
busiest stage's compute per micro-batch t (its forward and backward alone, without the pipeline),
and the measured bubble 1 - m t / T beside the model's (p - 1) / (m + p - 1). What the bubble
does not explain is the point-to-point traffic and the schedule's own overhead.

Not part of CI: figures go to docs/PERF.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import tprt  # noqa: F401 - before torch
import torch

CACHE = Path(tempfile.gettempdir()) / "tprt-pp-bench"
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=8192, max_position_embeddings=4096, num_hidden_layers=8)


def prepare() -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from convert import api

    tp1 = CACHE / "llama-tp1"
    if not tp1.exists():
        torch.manual_seed(0)
        hf = CACHE / "llama-hf"
        LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)).save_pretrained(hf)
        api.hf_to_tp(hf, tp1, 1)
    return tp1


def rank(tp1: Path, pp: int, micro: list[int], seq: int, repeats: int) -> dict[int, tuple[float, float]]:
    """One stage: for each m, (median step time, this stage's compute per micro-batch)."""
    import torch.distributed as dist

    from tprt.checkpoint.loading import load_stage
    from tprt.model.stage import stage_loss
    from tprt.distributed.context import init_distributed
    from tprt.parallel.stages import stages
    from tprt.train.pipeline import PipelineTrainer, pipeline_mesh

    torch.set_num_threads(1)
    init_distributed(tp_size=1)
    mesh = pipeline_mesh(1, pp)
    stage = stages(SHAPE["num_hidden_layers"], pp)[mesh.stage_index]
    model = load_stage(tp1, mesh.tp, stage, "fp32", requires_grad=True).train()
    out: dict[int, tuple[float, float]] = {}
    g = torch.Generator().manual_seed(0)
    for m in micro:
        trainer = PipelineTrainer(model, mesh, m)
        ids = torch.randint(3, SHAPE["vocab_size"], (m, seq), generator=g)
        steps = []
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.step(ids, ids)
            dist.barrier()
            if i:
                steps.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        # this stage alone on one micro-batch: its forward (and loss, on the last) and backward
        x = ids[:1] if stage.first else torch.randn(1, seq, SHAPE["hidden_size"], requires_grad=True)
        alone = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            h = model(x)
            if stage.last:  # with its loss, as in the pipeline
                loss, _ = stage_loss(model, h, ids[:1])
                loss.backward()
            else:
                h.backward(torch.ones_like(h))
            if i:
                alone.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        out[m] = (statistics.median(steps), statistics.median(alone))
    return out


def main() -> None:
    from tprt.distributed.launcher import launch_local

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--micro", default="2,4,8")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    micro = [int(x) for x in a.micro.split(",")]
    results = launch_local(a.pp, rank, (prepare(), a.pp, micro, a.seq, a.repeats), timeout_s=1800)
    print(f"random Llama {SHAPE}, fp32, PP {a.pp} x TP 1 (one rank per stage), rows of {a.seq} tokens, "
          "one row per micro-batch, 1F1B")
    print(f"{'m':>3} | {'step ms':>8} | {'t ms (busiest stage)':>20} | {'bubble measured':>15} | {'(p-1)/(m+p-1)':>13}")
    for m in micro:
        step = max(r[m][0] for r in results)
        t = max(r[m][1] for r in results)
        print(f"{m:>3} | {step * 1e3:8.1f} | {t * 1e3:20.1f} | {1 - m * t / step:15.2f} | "
              f"{(a.pp - 1) / (m + a.pp - 1):13.2f}")


if __name__ == "__main__":
    main()
