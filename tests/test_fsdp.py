"""`tprt finetune --full --dp 2`: FSDP2 over dp around the TP layers (tprt.train.fsdp), on gloo.

Against a single-process reference (a Trainer on one rank without process groups: the replicated
path) fed the same global batches: losses within 1e-5 and the exported weights within 1e-4, at
dp 2 x tp 2 and dp 2 x tp 1, with gradient accumulation and clipping, with and without
--offload-optimizer cpu. Each rank's AdamW state is measured at half the unsharded size, as the
planner predicts. A run killed with SIGKILL resumes from its DCP checkpoint at another dp degree
and logs the uninterrupted run's losses.
"""

from __future__ import annotations

import json
from dataclasses import replace
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tprt.checkpoint.loading import load_model
from tprt.cli.main import main
from tprt.distributed.context import TPContext
from tprt.train import checkpointing as ckpt
from tprt.train.plot import read_metrics
from train_fixtures import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
COMMON = ["--full", "--seq-len", "32", "--lr", "2e-3", "--max-grad-norm", "0.5", "--no-progress"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from convert.api import hf_to_tp

    root = tmp_path_factory.mktemp("fsdp")
    hf, tp2 = make_tiny_model(root, tp=2)
    tp1 = root / "gqa-tp1"
    hf_to_tp(hf, tp1, 1)
    data = root / "data.jsonl"
    texts = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris.",
             "Hello world, hello there!", "Numbers 12345 and symbols #$%^&*().", "You are a helpful assistant.",
             "The capital of France is Paris. The quick brown fox.", "tabs\tand  spaces\nnew lines",
             "Answer briefly: the lazy dog sleeps."]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return {"root": root, "tp1": tp1, "tp2": tp2, "data": data}


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def _reference(s: dict[str, Path], rows_per_micro: int, accum: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process run: one rank, no process group, the replicated path."""
    from tprt.text.tokenizer import Tokenizer
    from tprt.train.data import prepare_data
    from tprt.train.trainer import FinetuneConfig, OptimSettings, Trainer

    cfg = FinetuneConfig(model=s["tp1"], data=s["data"], out=s["root"] / f"ref-{rows_per_micro}-{accum}", full=True,
                         steps=STEPS, optim=OptimSettings(lr=2e-3, max_grad_norm=0.5), batch_size=rows_per_micro, grad_accum=accum,
                         seq_len=32, dtype="fp32", progress=False)
    data = prepare_data(s["data"], Tokenizer.from_dir(s["tp1"]), 32, 0)
    trainer = Trainer(cfg, TPContext.single(), data)
    losses = [trainer.train_step()[0] for _ in range(STEPS)]
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("tp, offload, sp", [(2, "none", False), (1, "cpu", False), (2, "cpu", False),
                                             (2, "none", True)])
def test_dp2_full_finetune_equals_the_single_process_reference(setup: dict[str, Path], tp: int, offload: str,
                                                               sp: bool) -> None:
    """(`sp`: sequence parallelism, and the TP backward's collectives overlapped.)"""
    from convert.api import reshard

    out = setup["root"] / f"dp2-tp{tp}-{offload}{'-sp' if sp else ''}"
    assert main(["finetune", "--model", str(setup[f"tp{tp}"]), "--data", str(setup["data"]), "--out", str(out),
                 *COMMON, "--steps", str(STEPS), "--dp", "2", "--batch-size", "1", "--grad-accum", "2",
                 "--offload-optimizer", offload, *(["--sequence-parallel", "--tp-comm-overlap", "on"] if sp else [])]) == 0
    ref_losses, ref_params = _reference(setup, 2, 2)
    losses = _losses(out)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    model_dir = out / "model"
    if tp > 1:
        reshard(model_dir, setup["root"] / f"{out.name}-tp1", 1)
        model_dir = setup["root"] / f"{out.name}-tp1"
    ours = load_model(model_dir, TPContext.single(), dtype="fp32").state_dict()
    assert ours.keys() == ref_params.keys()
    for k, ref in ref_params.items():
        assert torch.allclose(ours[k], ref, rtol=0, atol=1e-4), (k, float((ours[k] - ref).abs().max()))
    base = load_model(setup["tp1"], TPContext.single(), dtype="fp32").state_dict()
    assert any(not torch.allclose(base[k], ref_params[k], atol=1e-3) for k in base)  # it trained


def _optimizer_bytes_after_a_step(model: Path, data: Path, out: Path) -> tuple[int, int]:
    """One rank of a dp 2 world: (this rank's AdamW state bytes, sharded parameters per rank)."""
    from tprt.distributed.context import init_distributed
    from tprt.text.tokenizer import Tokenizer
    from tprt.train.data import prepare_data
    from tprt.train.fsdp import make_mesh, optimizer_state_bytes
    from tprt.train.trainer import FinetuneConfig, Trainer

    ctx = init_distributed(tp_size=1)
    cfg = FinetuneConfig(model=model, data=data, out=out, full=True, steps=1, batch_size=1, seq_len=32,
                         dtype="fp32", progress=False)
    trainer = Trainer(cfg, ctx, prepare_data(data, Tokenizer.from_dir(model), 32, 0), mesh=make_mesh(ctx))
    trainer.train_step()
    return optimizer_state_bytes(trainer.optimizer), sum(p.to_local().numel() for p in trainer.params)


def test_each_rank_holds_half_the_optimizer_state_as_planned(setup: dict[str, Path]) -> None:
    from tprt.distributed.launcher import launch_local
    from tprt.plan.devices import device
    from tprt.plan.memory import FinetuneWorkload, plan_memory
    from tprt.plan.source import read_source

    results = launch_local(2, _optimizer_bytes_after_a_step, (setup["tp1"], setup["data"], setup["root"] / "half"),
                           timeout_s=120)
    unsharded = sum(p.numel() for p in load_model(setup["tp1"], TPContext.single()).parameters())
    (bytes0, params0), (bytes1, params1) = results
    assert params0 + params1 == unsharded and bytes0 + bytes1 == 8 * unsharded
    assert abs(bytes0 - 4 * unsharded) <= 0.01 * 4 * unsharded  # half, up to a row of each odd-sized tensor
    src = read_source(setup["tp1"])
    plan = plan_memory(src.config, 1, FinetuneWorkload(full=True, sharded=True, dtype="fp32", batch_size=1, seq_len=32),
                       device("cpu"), dp=2, vocab_align=src.vocab_align)
    assert plan.per_rank_bytes["optimizer_states"] == bytes0  # rank 0 holds the larger shards


def _logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def test_sigkill_and_resume_at_another_dp_degree_repeats_the_loss_curve(setup: dict[str, Path]) -> None:
    steps, kill_after = 10, 5
    args = ["finetune", "--model", str(setup["tp2"]), "--data", str(setup["data"]), *COMMON, "--steps", str(steps),
            "--save-every", "2", "--lr", "3e-3"]
    dp2 = ["--dp", "2", "--batch-size", "1"]
    ref = setup["root"] / "kill-ref"
    assert main([*args, "--out", str(ref), *dp2]) == 0
    out = setup["root"] / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tprt.cli", *args, "--out", str(out), *dp2], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while _logged_steps(out) < kill_after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert kill_after <= _logged_steps(out) < steps and not (out / "model").exists(), "not killed mid-run"
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None and (latest / "dcp-tp00001").is_dir()
    # dp 2 -> dp 1 with twice the rows per micro-batch: the same global batches
    assert main([*args, "--out", str(out), "--batch-size", "2", "--resume"]) == 0
    losses, expected = _losses(out), _losses(ref)
    assert len(losses) == steps
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, expected)), (losses, expected)


def test_planner_fits_70b_full_finetuning_on_one_8xh100_node_only_with_offload() -> None:
    from tprt.plan.devices import device
    from tprt.plan.memory import FinetuneWorkload, plan_memory
    from tprt.plan.source import read_source

    src = read_source(ROOT / "bench" / "configs" / "llama-3.1-70b")
    w = FinetuneWorkload(full=True, sharded=True, dtype="bf16", batch_size=1, seq_len=4096,
                         activation_checkpointing=True)
    h100 = device("h100-80gb")
    plain = plan_memory(src.config, 8, w, h100)
    offloaded = plan_memory(src.config, 8, replace(w, offload_optimizer=True), h100)
    assert not plain.fits and offloaded.fits
    moved = offloaded.extra["host_bytes_per_rank"]
    assert moved == 16 * offloaded.extra["sharded_params_per_rank"]  # fp32 shard, gradient, two moments
    assert plain.peak_bytes_per_rank - offloaded.peak_bytes_per_rank == moved
    halved = plan_memory(src.config, 4, w, h100, dp=2)  # the same 8 GPUs as dp 2 x tp 4: state halves
    assert halved.per_rank_bytes["optimizer_states"] < 0.51 * plan_memory(src.config, 4, w, h100).per_rank_bytes["optimizer_states"]
