"""Generation benchmark on the real SmolLM2-135M-Instruct, against peers measured in the same run.

    python bench/generate_bench.py                      # everything, about 5-10 minutes on 2 cores
    python bench/generate_bench.py --quick              # fewer repeats and tokens

Peers: transformers' `generate` on the same weights (same dtype, same threads), and the memory
bandwidth floor: read bandwidth is measured in this process by summing a large tensor, and
floor tokens/s = bandwidth / bytes of weights read per decoded token. Reported:

- batch-1 decode tokens/s in fp32 and bf16 (ours, transformers, floor; ratios)
- aggregate decode tokens/s with 2 and 4 sequences (ours) and 16 (ratio to batch 1)
- prefill tokens/s for a 512-token prompt (ours, transformers)
- TP=3 (3 local ranks, gloo) against TP=1 for batch-1 decode, and the share of a token's time
  spent in all-reduces (the same collectives timed alone in the same world)

Decode rates are differences: (n2 - n1) tokens / (time of n2 - time of n1), best of --repeats, so
prefill and start-up cancel out. The machine may be shared: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tprt  # noqa: E402, F401 - before torch: its allocator setting applies to every peer alike
import torch  # noqa: E402

from tprt.distributed.context import TPContext, init_distributed  # noqa: E402
from tprt.engine.core import Engine, EngineConfig, run_to_completion  # noqa: E402
from tprt.checkpoint.loading import load_model  # noqa: E402
from tprt.model.llama import TPLlamaForCausalLM  # noqa: E402
from tprt.cpu.hugepages import huge_empty  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402
from tprt.text.tokenizer import Tokenizer  # noqa: E402

QUESTION = "Write a long story about a cat who learns to play the piano."


def prepare(workdir: Path) -> Path:
    """workdir/hf, tp1, tp3 from the bundled GGUF (kept between runs)."""
    from convert.api import gguf_to_hf, hf_to_tp
    from tprt.cli.demo import smollm2_gguf

    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "hf").exists():
        gguf_to_hf(smollm2_gguf(), workdir / "hf")
    for tp in (1, 3):
        if not (workdir / f"tp{tp}").exists():
            hf_to_tp(workdir / "hf", workdir / f"tp{tp}", tp=tp)
    return workdir


CLOCK: Callable[[], float] = time.perf_counter  # --clock cpu: time.process_time


def best(fn: Callable[[], Any], repeats: int) -> float:
    """The shortest of `repeats` timed calls, in seconds of CLOCK."""
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times)


def read_bandwidth(repeats: int) -> float:
    """Bytes/s of summing a 512 MiB float32 tensor (the read side of a memory-bound matvec), on
    huge pages like our weights (tprt.cpu.hugepages): a floor measured on small pages would be lower."""
    x = huge_empty(512 * 1024 * 1024).view(torch.float32).fill_(1.0)
    x.sum()
    return x.nbytes / best(lambda: x.sum(), repeats)


def weight_bytes(model: TPLlamaForCausalLM) -> int:
    """Bytes of weights read per decoded token: every parameter once (a tied embedding is read once,
    by the LM head); an untied input embedding reads only one row and is left out."""
    total = sum(p.nbytes for p in model.parameters())
    if not model.config.tie_word_embeddings:
        total -= model.embed_tokens.weight.nbytes
    return total


def ours_decode(engine: Engine, prompt: list[int], batch: int, n1: int, n2: int, repeats: int) -> float:
    """Aggregate decode tokens/s of `batch` sequences on this engine (TP rank 0)."""

    def run(n: int) -> None:
        for i in range(batch):
            engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), str(i))
        run_to_completion(engine)

    run(2)
    t1, t2 = best(lambda: run(n1), repeats), best(lambda: run(n2), repeats)
    return batch * (n2 - n1) / (t2 - t1)


def hf_decode(model: Any, prompt: list[int], batch: int, n1: int, n2: int, repeats: int) -> float:
    x = torch.tensor([prompt] * batch)

    def run(n: int) -> None:
        with torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=2)

    run(2)
    t1, t2 = best(lambda: run(n1), repeats), best(lambda: run(n2), repeats)
    return batch * (n2 - n1) / (t2 - t1)


def prefill_rates(engine: Engine, hf: Any, n: int, repeats: int) -> tuple[float, float]:
    """Tokens/s of prefilling one n-token prompt (and sampling one token): ours, transformers."""
    prompt = [(i * 7919) % 40000 + 100 for i in range(n)]

    def ours() -> None:
        engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=1), "p")
        run_to_completion(engine)

    def theirs() -> None:
        with torch.no_grad():
            hf(torch.tensor([prompt]), use_cache=True)

    ours()
    theirs()
    return n / best(ours, repeats), n / best(theirs, repeats)


def single_rank(workdir: Path, args: argparse.Namespace, bw: float) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    tok = Tokenizer.from_dir(workdir / "tp1")
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    n1, n2 = args.tokens // 4, args.tokens
    out: dict[str, Any] = {"prompt_tokens": len(prompt)}
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_model(workdir / "tp1", TPContext.single(), dtype)
        engine = Engine(model, tok, EngineConfig(max_batch=16, max_seq_len=max(640, len(prompt) + n2 + 8)))
        hf = LlamaForCausalLM.from_pretrained(workdir / "hf", dtype=torch_dtype).eval()
        r: dict[str, Any] = {"weight_bytes": weight_bytes(model)}
        r["floor"] = bw / r["weight_bytes"]
        r["ours_b1"] = ours_decode(engine, prompt, 1, n1, n2, args.repeats)
        r["hf_b1"] = hf_decode(hf, prompt, 1, n1, n2, args.repeats)
        for batch in (2, 4):  # a few sequences: tprt's few-row kernels (tprt.cpu.native.gemv_rows_kernel)
            r[f"ours_b{batch}"] = ours_decode(engine, prompt, batch, n1 // 2, n2 // 2, args.repeats)
        r["ours_b16"] = ours_decode(engine, prompt, 16, n1 // 2, n2 // 2, args.repeats)
        r["hf_b16"] = hf_decode(hf, prompt, 16, n1 // 2, n2 // 2, args.repeats)
        r["ours_prefill512"], r["hf_prefill512"] = prefill_rates(engine, hf, 512, args.repeats)
        out[dtype] = r
        print(f"[{dtype}] {json.dumps(r)}", file=sys.stderr, flush=True)
        del engine, model, hf
    return out


def _tp_rank(workdir: str, tokens: int, repeats: int) -> dict[str, float] | None:
    """Batch-1 fp32 decode on this TP world, then the same all-reduces timed alone."""
    import torch.distributed as dist

    ctx = init_distributed()
    model = load_model(Path(workdir) / f"tp{ctx.world_size}", ctx, "fp32")
    tok = Tokenizer.from_dir(Path(workdir) / f"tp{ctx.world_size}")
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    engine = Engine(model, tok, EngineConfig(max_batch=1, max_seq_len=len(prompt) + tokens + 8))
    if not engine.is_driver:
        engine.follow()
    else:
        with engine:
            rate = ours_decode(engine, prompt, 1, tokens // 4, tokens, repeats)
    # Per decoded token: 1 embedding + 2 per layer all-reduces of [1, 1, hidden], and the greedy
    # all-gather of one (value, id) pair per rank; plus the plan broadcast (2 small broadcasts).
    h = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.float32)
    pair = torch.zeros(1, 2, dtype=torch.float64)
    parts = [torch.empty_like(pair) for _ in range(ctx.world_size)]
    n_steps = 32

    def comm() -> None:
        for _ in range(n_steps):
            for _ in range(1 + 2 * model.config.num_hidden_layers):
                dist.all_reduce(h, group=ctx.group)
            dist.all_gather(parts, pair, group=ctx.group)
            dist.broadcast(torch.zeros(1, dtype=torch.int64), group=ctx.group, group_src=0)
            dist.broadcast(torch.zeros(16, dtype=torch.int64), group=ctx.group, group_src=0)

    dist.barrier(group=ctx.group)
    comm_s = best(comm, repeats) / n_steps
    if not engine.is_driver:
        return None
    return {"tokens_per_s": rate, "comm_s_per_token": comm_s, "allreduce_share": comm_s * rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-generate-bench"))
    ap.add_argument("--tokens", type=int, default=96, help="decode tokens of the long run (the short one is 1/4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for TP=1 and transformers (default 1: on a shared machine more threads "
                         "than free cores make every op wait for a descheduled thread)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time, robust to other load (single-process numbers only; "
                         "TP=3 is always wall time)")
    ap.add_argument("--quick", action="store_true", help="--tokens 48 --repeats 2")
    ap.add_argument("--no-tp3", action="store_true", help="skip the TP=3 comparison")
    ap.add_argument("--only-tp3", action="store_true", help="only the TP=3 comparison")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats = 48, 2
    global CLOCK
    torch.set_num_threads(args.threads)
    workdir = prepare(args.workdir)
    if args.clock == "cpu":
        CLOCK = time.process_time
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    bw = read_bandwidth(10)
    result: dict[str, Any] = {"threads": args.threads, "clock": args.clock, "read_bandwidth_GBps": bw / 1e9}
    if not args.only_tp3:
        result.update(single_rank(workdir, args, bw))
    if not args.no_tp3:
        from tprt.distributed.launcher import launch_local

        CLOCK = time.perf_counter
        job = (str(workdir), args.tokens // 2, args.repeats)
        tp3 = launch_local(3, _tp_rank, job, threads_per_rank=1)[0]
        tp1 = launch_local(1, _tp_rank, job, threads_per_rank=1)[0]
        result["tp3_vs_tp1"] = {"tp3": tp3, "tp1_one_thread": tp1, "ratio": tp3["tokens_per_s"] / tp1["tokens_per_s"]}
    result["read_bandwidth_after_GBps"] = read_bandwidth(10) / 1e9  # the floor uses the first measurement
    result["load_average_after"] = os.getloadavg()
    report(result)


def report(r: dict[str, Any]) -> None:
    print(json.dumps(r, indent=1))
    print(f"\nread bandwidth {r['read_bandwidth_GBps']:.1f} GB/s, {r['threads']} thread(s), {r['clock']} clock, "
          f"prompt {r.get('prompt_tokens')} tokens")
    for dt in ("fp32", "bf16") if "fp32" in r else ():
        x = r[dt]
        print(f"{dt}: batch-1 decode {x['ours_b1']:.1f} tok/s | transformers {x['hf_b1']:.1f} "
              f"({x['ours_b1'] / x['hf_b1']:.2f}x) | floor {x['floor']:.1f} ({x['ours_b1'] / x['floor']:.0%} of floor)")
        print(f"{dt}: 2 / 4 sequences {x['ours_b2']:.1f} / {x['ours_b4']:.1f} tok/s "
              f"({x['ours_b2'] / x['ours_b1']:.1f}x / {x['ours_b4'] / x['ours_b1']:.1f}x batch 1)")
        print(f"{dt}: 16 sequences {x['ours_b16']:.1f} tok/s ({x['ours_b16'] / x['ours_b1']:.1f}x batch 1) | "
              f"transformers {x['hf_b16']:.1f} ({x['ours_b16'] / x['hf_b16']:.2f}x)")
        print(f"{dt}: prefill 512 tokens {x['ours_prefill512']:.0f} tok/s | transformers {x['hf_prefill512']:.0f} "
              f"({x['ours_prefill512'] / x['hf_prefill512']:.2f}x)")
    if "tp3_vs_tp1" in r:
        t = r["tp3_vs_tp1"]
        print(f"TP=3 batch-1 fp32 decode {t['tp3']['tokens_per_s']:.1f} tok/s vs TP=1 (1 thread) "
              f"{t['tp1_one_thread']['tokens_per_s']:.1f} ({t['ratio']:.2f}x); all-reduce share of a TP=3 token "
              f"{t['tp3']['allreduce_share']:.0%} ({t['tp3']['comm_s_per_token'] * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
