"""Sequence parallelism's activation memory, and the overlapped TP backward's time (issue 44).

    python bench/sp_bench.py [--seq 1024] [--layers 4] [--repeats 5]

On a random Llama (hidden 512, 8 heads, 4 kv heads, intermediate 1408, vocab 8192), fp32, one
row of --seq tokens, every rank of a gloo world on this machine:

- memory: each rank's activations, as `tprt plan` counts them (the peak of its resident memory
  over a forward and backward of `compute_loss` above the start, less the gradients the step
  made; measured as tests/memprobe.py does: freed memory goes back to the kernel, after a
  warm-up round of every case), LoRA (q,k,v,o, rank 16) and full fine-tuning, with and without
  --sequence-parallel and --activation-checkpointing, at TP 2 and 4; against TP 1, and against
  `tprt plan`'s activations for the same workload (the ratio measured / planned);
- time: a full fine-tune's backward at TP 2 with the input gradients' collectives overlapped
  with the weight gradients (tprt.parallel.overlap) and without, median of --repeats.

Not part of CI: figures go to docs/PERF.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tprt  # noqa: F401 - before torch
import torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(tempfile.gettempdir()) / "tprt-sp-bench"
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=8192, max_position_embeddings=8192)
LORA = (("q", "k", "v", "o"), 16, 32.0)


def prepare(layers: int) -> Path:
    """The HF directory of the random Llama and its TP 1/2/4 checkpoints, written once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from convert import api

    hf = CACHE / f"llama-{layers}l-hf"
    if not hf.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SHAPE, num_hidden_layers=layers, tie_word_embeddings=False)).save_pretrained(hf)
    for tp in (1, 2, 4):
        if not (CACHE / f"llama-{layers}l-tp{tp}").exists():
            api.hf_to_tp(hf, CACHE / f"llama-{layers}l-tp{tp}", tp)
    return hf


def _model(tp_dir: Path, ctx: Any, method: str, sp: bool, ckpt: bool, overlap: bool) -> Any:
    from tprt.checkpoint.loading import load_model
    from tprt.lora.attach import apply_lora
    from tprt.train.step import enable_activation_checkpointing, enable_sequence_parallel, enable_tp_comm_overlap

    model = load_model(tp_dir, ctx, dtype="fp32", requires_grad=method == "full").train()
    enable_sequence_parallel(model, sp)
    enable_tp_comm_overlap(model, overlap)
    enable_activation_checkpointing(model, ckpt)
    if method == "lora":
        targets, rank, alpha = LORA
        apply_lora(model, targets, rank, alpha)
    return model


def memory_rank(tp_dir: Path, seq: int, cases: list[tuple[str, bool, bool]]) -> list[int]:
    """One rank: its activations' peak bytes in one step, per (method, sp, checkpointing)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from memprobe import MemoryProbe

    from tprt.checkpoint.format import TPCheckpoint
    from tprt.distributed.context import init_distributed
    from tprt.train.step import compute_loss

    torch.set_num_threads(1)
    ctx = init_distributed(tp_size=TPCheckpoint(tp_dir).tp_size)
    ids = torch.randint(3, SHAPE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    out = []
    for i, (method, sp, ckpt) in enumerate([*cases, *cases]):  # the first round a warm-up: one-time allocations
        model = _model(tp_dir, ctx, method, sp, ckpt, overlap=False)  # as the trainer runs them on CPU
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        probe = MemoryProbe()
        before = probe.now()
        probe.restart_peak()
        loss, n = compute_loss(model, ids, ids)
        (loss / n).backward()
        if i >= len(cases):  # the step's peak above the start, less the gradients it made (the plan's activations)
            out.append(probe.peak() - before - grads)
        del model, loss, n
    return out


def backward_rank(tp_dir: Path, seq: int, repeats: int, sp: bool) -> dict[str, float]:
    """One rank: a full fine-tune's backward time with the overlap on and off (alternating)."""
    import torch.distributed as dist

    from tprt.checkpoint.format import TPCheckpoint
    from tprt.distributed.context import init_distributed
    from tprt.train.step import compute_loss, enable_tp_comm_overlap

    torch.set_num_threads(1)
    ctx = init_distributed(tp_size=TPCheckpoint(tp_dir).tp_size)
    model = _model(tp_dir, ctx, "full", sp, ckpt=False, overlap=False)
    ids = torch.randint(3, SHAPE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * (repeats + 1)):
        mode = "on" if i % 2 else "off"
        enable_tp_comm_overlap(model, mode == "on")
        loss, n = compute_loss(model, ids, ids)
        dist.barrier()
        t0 = time.perf_counter()
        (loss / n).backward()
        dist.barrier()
        if i >= 2:  # after a warm-up round of each
            times[mode].append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {mode: statistics.median(ts) for mode, ts in times.items()}


def planned(hf: Path, tp: int, seq: int, method: str, sp: bool, ckpt: bool) -> int:
    from tprt.model.config import ModelConfig
    from tprt.plan.devices import device
    from tprt.plan.memory import FinetuneWorkload, plan_memory

    targets, rank, _ = LORA
    w = FinetuneWorkload(full=method == "full", lora_rank=rank, lora_targets=targets, dtype="fp32", batch_size=1,
                         seq_len=seq, activation_checkpointing=ckpt, sequence_parallel=sp)
    plan = plan_memory(ModelConfig.from_file(hf / "config.json"), tp, w, device("cpu"))
    return int(plan.per_rank_bytes["activations"])


def main() -> None:
    from tprt.distributed.launcher import launch_local

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    hf = prepare(a.layers)
    cases = [(m, sp, ck) for m in ("lora", "full") for ck in (False, True) for sp in (False, True)]
    print(f"random Llama {SHAPE}, {a.layers} layers, fp32, 1 x {a.seq} tokens; activations (peak) per rank, MiB "
          "(measured; planned; measured / planned)")
    print(f"{'method':>6} {'ckpt':>4} {'SP':>3} | " + " | ".join(f"{'TP ' + str(tp):^26}" for tp in (1, 2, 4)))
    rows: dict[int, list[int]] = {}
    for tp in (1, 2, 4):
        tp_dir = CACHE / f"llama-{a.layers}l-tp{tp}"
        mine = cases if tp > 1 else [c for c in cases if not c[1]]
        results = launch_local(tp, memory_rank, (tp_dir, a.seq, mine), timeout_s=1800)
        per_case = [max(r[i] for r in results) for i in range(len(mine))]
        rows[tp] = [per_case[mine.index(c)] if c in mine else per_case[mine.index((c[0], False, c[2]))] for c in cases]
    for i, (method, sp, ckpt) in enumerate(cases):
        cells = []
        for tp in (1, 2, 4):
            plan = planned(hf, tp, a.seq, method, sp and tp > 1, ckpt)
            cells.append(f"{rows[tp][i] / 2**20:7.1f}; {plan / 2**20:7.1f}; {rows[tp][i] / plan:4.2f}")
        print(f"{method:>6} {'on' if ckpt else 'off':>4} {'on' if sp else 'off':>3} | " + " | ".join(cells))
    for sp in (False, True):
        res = launch_local(2, backward_rank, (CACHE / f"llama-{a.layers}l-tp2", a.seq, a.repeats, sp), timeout_s=1800)
        on, off = max(r["on"] for r in res), max(r["off"] for r in res)
        print(f"full fine-tune backward at TP 2{' with SP' if sp else ''}: overlapped {on * 1e3:.1f} ms, "
              f"not {off * 1e3:.1f} ms: {off / on:.2f}x")


if __name__ == "__main__":
    main()
