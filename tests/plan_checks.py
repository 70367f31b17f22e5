"""Checks of tprt's memory planner (tprt.plan) against this machine: the planned per-rank peak
of serving, LoRA and full fine-tuning against the measured one (RSS high-water mark above the
baseline, tests/memprobe.py), within `TOLERANCE`. Run in the SmolLM2 worlds (tests/test_smollm2.py)
at TP 1 and 3, on the real model's shapes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from memprobe import MemoryProbe
from tprt.checkpoint.loading import load_model
from tprt.distributed.context import TPContext
from tprt.engine.core import Engine, EngineConfig, run_to_completion
from tprt.engine.sampling import SamplingParams
from tprt.model.config import ModelConfig
from tprt.plan.devices import device
from tprt.plan.memory import CPU_TRITON_RESERVE, FinetuneWorkload, MemoryPlan, ServeWorkload, Workload, plan_memory

TOLERANCE = 0.15
MiB = 1 << 20


def _plan(wd: Path, ctx: TPContext, workload: Workload) -> MemoryPlan:
    cfg = ModelConfig.from_file(wd / f"tp{ctx.world_size}" / "config.json")
    return plan_memory(cfg, ctx.world_size, workload, device("cpu"))


def _compare(plan: MemoryPlan, measured: int, what: str) -> None:
    planned = plan.peak_bytes_per_rank
    parts = ", ".join(f"{k} {v / MiB:.0f}" for k, v in plan.per_rank_bytes.items() if v)
    assert abs(planned - measured) <= TOLERANCE * measured, \
        f"{what}: planned {planned / MiB:.0f} MiB ({parts}) vs measured {measured / MiB:.0f} MiB"


def _serve(ctx: TPContext, wd: Path, workload: ServeWorkload) -> int:
    """An engine with its KV cache, after a batch of requests; the peak RSS."""
    probe = MemoryProbe()
    model = load_model(wd / f"tp{ctx.world_size}", ctx, workload.dtype)
    probe.restart_peak()  # the rank file's mmapped pages are not the model's memory
    engine = Engine(model, None, EngineConfig(max_batch=workload.max_batch_size, max_seq_len=workload.max_seq_len,
                                              cpu_prepack=workload.cpu_prepack))
    if not engine.is_driver:
        engine.follow()
    else:
        with engine:
            for i in range(workload.max_batch_size):
                engine.add(list(range(10 + i, 50 + i)), SamplingParams(temperature=0.0, max_new_tokens=8), str(i))
            run_to_completion(engine)
    return probe.peak()


def check_plan_serve(ctx: TPContext, wd: Path) -> None:
    """Serving without CPU prepacking: weights, KV cache and a step's activations."""
    workload = ServeWorkload(dtype="fp32", max_seq_len=128, max_batch_size=4, cpu_prepack=False)
    _compare(_plan(wd, ctx, workload), _serve(ctx, wd, workload), "serving")


def check_plan_serve_prepacked(ctx: TPContext, wd: Path) -> None:
    """The engine's default CPU prepacking keeps one or two copies of the linear weights,
    depending on which one-row kernels win the timing, so the plan (two copies) is an upper
    bound: the measured peak must lie between the plan without copies and the plan + 15%."""
    workload = ServeWorkload(dtype="fp32", max_seq_len=128, max_batch_size=4)
    bound = _plan(wd, ctx, workload).peak_bytes_per_rank
    floor = _plan(wd, ctx, ServeWorkload(dtype="fp32", max_seq_len=128, max_batch_size=4, cpu_prepack=False))
    measured = _serve(ctx, wd, workload)
    assert floor.peak_bytes_per_rank < measured <= (1 + TOLERANCE) * bound, \
        f"prepacked serving: measured {measured / MiB:.0f} MiB, planned at most {bound / MiB:.0f} MiB " \
        f"and more than {floor.peak_bytes_per_rank / MiB:.0f} MiB without copies"


def _train_steps(ctx: TPContext, wd: Path, workload: FinetuneWorkload) -> int:
    """Two steps of the trainer's forward, backward, gradient sync and AdamW; the peak RSS."""
    from tprt.cpu.fast_linear import prepack
    from tprt.lora.attach import apply_lora
    from tprt.train.grads import clip_grad_norm, sync_gradients
    from tprt.train.optim import AdamW
    from tprt.train.step import compute_loss

    # torch's optimizer step imports torch._dynamo (and Triton, where installed) once per process:
    # imported before the probe, so every TP measures the same (the TP 1 world is the test process,
    # which may have imported it already), and added back below as the plan counts it.
    import torch._dynamo  # noqa: F401

    probe = MemoryProbe()
    model = load_model(wd / f"tp{ctx.world_size}", ctx, workload.dtype, requires_grad=workload.full)
    probe.restart_peak()
    if workload.full:
        params = [p for p in model.parameters() if p.requires_grad]
    else:  # as Trainer._trainable
        params = apply_lora(model, list(workload.lora_targets), workload.lora_rank, 16.0, 0.0, seed=0)
        prepack(model, tune=False)
    optimizer = AdamW(params, lr=1e-4)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (workload.batch_size, workload.seq_len),
                        generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second step runs with the optimizer's states allocated
        loss, _ = compute_loss(model, ids, ids)
        loss.backward()
        sync_gradients(model, ctx)
        clip_grad_norm(params, 1.0, ctx)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    triton = importlib.util.find_spec("triton") is not None
    return probe.peak() + (CPU_TRITON_RESERVE if triton else 0)


def check_plan_lora(ctx: TPContext, wd: Path) -> None:
    workload = FinetuneWorkload(lora_rank=8, lora_targets=("q", "k", "v", "o"), dtype="fp32", batch_size=1, seq_len=64)
    _compare(_plan(wd, ctx, workload), _train_steps(ctx, wd, workload), "LoRA step")


def check_plan_full(ctx: TPContext, wd: Path) -> None:
    workload = FinetuneWorkload(full=True, dtype="fp32", batch_size=1, seq_len=64)
    _compare(_plan(wd, ctx, workload), _train_steps(ctx, wd, workload), "full fine-tuning step")


CHECKS = [("plan_serve", check_plan_serve), ("plan_lora", check_plan_lora), ("plan_full", check_plan_full)]
# Prepacking times kernels for seconds per rank: checked in-process at TP 1 only.
CHECKS_TP1 = [*CHECKS, ("plan_serve_prepacked", check_plan_serve_prepacked)]
