"""Serving benchmark on the real SmolLM2-135M-Instruct: `tprt serve` on loopback against the
in-process engine measured in the same run.

    python bench/serve_bench.py                        # TP 1, 1/4/16/64 streams, 64 tokens each
    python bench/serve_bench.py --tp 2 --tokens 32     # TP 2 (local gloo ranks)

Reported, per concurrency level c (c streams started together, each greedy, `--tokens` tokens
with EOS ignored): aggregate generated tokens/s (all tokens / wall time of the round) and p50/p99
time to first token (best of 3 rounds; one stream: best of --repeats). Peers in the same run:

- the in-process engine (`tprt.engine.core.Engine`, same checkpoint, batch, context and threads) at
  one stream, best of --repeats runs alternating with the server's (TP 1: in this process; TP > 1:
  on local ranks before and after the server): gRPC overhead = 1 - server tokens/s / engine tokens/s (target < 5%);
- the server at one stream: 16 streams / 1 stream aggregate throughput (target >= 6x).

Prefix reuse (tprt.engine.prefix_cache) is on, as `tprt serve` runs by default: the rounds repeat the
same 4 prompts, so after the first round most prompt tokens are reused (each level prints the
share). `--unique-prompts` makes every prompt distinct (only the chat template's system prompt
stays shared); `--no-prefix-cache` turns reuse off in the server and the peer alike.

Many adapters (`--adapters N`, e.g. `--adapters 8 --streams 16`): N random rank-`--lora-rank` PEFT
adapters on every projection are written under the server's --data-dir/adapters/ and loaded on
demand; rounds of the same c streams, alternating, best of --repeats each: on the base model, all
on one adapter, spread over the N adapters (one batch mixes them), and spread over the N adapters
but scheduled one adapter per batch (each adapter's streams run together, one adapter after the
other: what a scheduler that batches one adapter at a time achieves at best). Reported: tokens/s
of each and mixed / one-adapter (goal >= 0.8). The prompts repeat, so prefix reuse favours the
one-adapter round (every stream shares its adapter's cached prompts); `--no-prefix-cache`
compares the adapters' compute alone.

Bounded: every call has a deadline, the server is stopped with SIGTERM (then killed) at the end.
The machine may be shared with other work: compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/: the adapter writer

import tprt  # noqa: E402, F401 - before torch: its allocator setting applies to the in-process peer too

PROMPTS = ["Write a long story about a cat who learns to play the piano.",
           "Explain how a steam engine works, step by step.",
           "List the planets of the solar system and describe each one.",
           "What is the capital of France? Tell me about its history."]


def prepare(workdir: Path, tp: int) -> Path:
    """workdir/hf and workdir/tp{tp} from the bundled GGUF (kept between runs)."""
    from convert.api import gguf_to_hf, hf_to_tp
    from tprt.cli.demo import smollm2_gguf

    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "hf").exists():
        gguf_to_hf(smollm2_gguf(), workdir / "hf")
    if not (workdir / f"tp{tp}").exists():
        hf_to_tp(workdir / "hf", workdir / f"tp{tp}", tp=tp)
    return workdir / f"tp{tp}"


class EnginePeer:
    """The in-process peer: this rank's model and an Engine configured like the server's."""

    def __init__(self, model_dir: str, max_batch: int, max_seq_len: int, dtype: str | None = None,
                 prefix_cache: bool = True) -> None:
        from tprt.distributed.context import init_distributed
        from tprt.engine.core import Engine, EngineConfig
        from tprt.checkpoint.loading import load_model
        from tprt.text.tokenizer import Tokenizer

        ctx = init_distributed()
        model = load_model(model_dir, ctx, dtype)
        self.tok = Tokenizer.from_dir(model_dir) if ctx.rank == 0 else None
        self.engine = Engine(model, self.tok, EngineConfig(max_batch=max_batch, max_seq_len=max_seq_len,
                                                           prefix_cache=prefix_cache))
        self.runs = 0
        self.unique = False  # make each prompt distinct (see --unique-prompts)

    def measure(self, prompt: str, tokens: int, streams: int = 1) -> dict[str, float]:
        """`streams` greedy requests added together on rank 0: aggregate tokens/s, median TTFT."""
        from tprt.engine.sampling import SamplingParams

        assert self.tok is not None
        params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
        t0 = time.perf_counter()
        for i in range(streams):
            text = prompt if streams == 1 else PROMPTS[i % len(PROMPTS)]
            text = unique(text) if self.unique else text
            self.engine.add(self.tok.encode_chat([{"role": "user", "content": text}]), params, f"r{self.runs}-{i}")
        self.runs += 1
        first: dict[str, float] = {}
        n = 0
        while self.engine.has_work:
            for ev in self.engine.step():
                if ev.token_id is not None:
                    n += 1
                    first.setdefault(ev.request_id, time.perf_counter() - t0)
        wall = time.perf_counter() - t0
        return {"tokens_per_s": n / wall, "ttft_s": statistics.median(first.values()) if first else 0.0}


_counter = itertools.count()


def unique(prompt: str) -> str:
    """The prompt made distinct from every other one sent: only the chat template's system prompt
    (SmolLM2's default) stays shared between requests."""
    return f"Request {next(_counter)}. {prompt}"


def engine_rank(model_dir: str, prompt: str, tokens: int, max_batch: int, max_seq_len: int,
                repeats: int, dtype: str | None = None, prefix_cache: bool = True,
                unique_prompts: bool = False) -> dict[str, float]:
    """One rank of the peer under the launcher (TP > 1): rank 0 returns the best of `repeats`."""
    peer = EnginePeer(model_dir, max_batch, max_seq_len, dtype, prefix_cache)
    peer.unique = unique_prompts
    if peer.tok is None:
        peer.engine.follow()
        return {}
    peer.measure(prompt, 8)  # warm-up
    best = max((peer.measure(prompt, tokens) for _ in range(repeats)), key=lambda r: r["tokens_per_s"])
    peer.engine.close()
    return best


def stream(client: Any, prompt: str, tokens: int, adapter_id: str = "") -> tuple[float, int, float, int, int]:
    """One greedy stream: (time to first token, tokens, wall seconds, prompt tokens, of them reused)."""
    t0 = time.perf_counter()
    first, n, usage = None, 0, None
    for msg in client.generate(chat=[{"role": "user", "content": prompt}], max_new_tokens=tokens,
                               temperature=0, ignore_eos=True, timeout=600, adapter_id=adapter_id):
        if msg.HasField("token"):
            n += 1
            first = first or time.perf_counter()
        if msg.HasField("usage"):
            usage = msg.usage
    prompt_tokens, reused = (usage.prompt_tokens, usage.cached_prompt_tokens) if usage is not None else (0, 0)
    return (first or t0) - t0, n, time.perf_counter() - t0, prompt_tokens, reused


def round_of(client: Any, c: int, tokens: int, unique_prompts: bool = False) -> dict[str, float]:
    """c streams started together: aggregate tokens/s, p50/p99 TTFT, share of prompt tokens reused."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
    prompts = [unique(p) for p in prompts] if unique_prompts else prompts
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = list(pool.map(lambda p: stream(client, p, tokens), prompts))
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    total = sum(r[1] for r in results)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    reused = sum(r[4] for r in results) / max(1, sum(r[3] for r in results))
    return {"streams": c, "tokens_per_s": total / wall, "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": p99,
            "prompt_reused": reused}


def write_adapters(model_dir: Path, data_dir: Path, n: int, rank: int) -> list[str]:
    """n random PEFT LoRA adapters (every projection, rank `rank`) under data_dir/adapters/; their ids."""
    from train_fixtures import write_random_adapter

    from tprt.lora.config import TARGETS
    from tprt.model.config import ModelConfig

    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    ids = [f"bench-{i}" for i in range(n)]
    for i, name in enumerate(ids):
        path = data_dir / "adapters" / name
        if not path.exists():
            write_random_adapter(path, config, TARGETS, rank, i, 0.01)
    return ids


def adapter_rounds(client: Any, ids: list[str], c: int, tokens: int, repeats: int) -> dict[str, float]:
    """Best tokens/s of each way of serving c streams (see the module docstring), rounds alternating."""
    def together(adapters: list[str]) -> tuple[int, float]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(adapters)) as pool:
            results = list(pool.map(lambda ia: stream(client, PROMPTS[ia[0] % len(PROMPTS)], tokens, ia[1]),
                                    enumerate(adapters)))
        return sum(r[1] for r in results), time.perf_counter() - t0

    def one_adapter_per_batch() -> tuple[int, float]:
        total, wall = 0, 0.0
        for name in ids:
            n, seconds = together([name] * (c // len(ids)))
            total, wall = total + n, wall + seconds
        return total, wall

    ways = {"base": lambda: together([""] * c), "one_adapter": lambda: together([ids[0]] * c),
            "mixed": lambda: together([ids[i % len(ids)] for i in range(c)]),
            "one_adapter_per_batch": one_adapter_per_batch}
    best = {k: 0.0 for k in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            n, seconds = way()
            best[name] = max(best[name], n / seconds)
    return best


def run_adapters(args: argparse.Namespace, model: Path) -> None:
    from serve.client import Client
    from serve.client.local import LocalServer

    c = max(args.streams)
    if c % args.adapters:
        raise SystemExit(f"--streams {c} must be a multiple of --adapters {args.adapters}")
    data = args.workdir / "data"
    ids = write_adapters(model, data, args.adapters, args.lora_rank)
    server = LocalServer(["--model", str(model), "--metrics-port", "-1", "--data-dir", str(data),
                          "--max-batch-size", str(c), "--max-queue", str(c), "--max-seq-len", str(args.max_seq_len),
                          "--threads", str(args.threads), "--log-level", "warning", "--max-loras", str(args.adapters),
                          *(["--dtype", args.dtype] if args.dtype else []),
                          *([] if args.prefix_cache else ["--no-prefix-cache"])], args.workdir / "server.log")
    try:
        with Client(server.target) as client:
            for name in ["", *ids]:  # warm-up; loads every adapter
                stream(client, PROMPTS[0], 4, name)
            best = adapter_rounds(client, ids, c, args.tokens, args.repeats)
    finally:
        server.stop()
    for name, tok_s in best.items():
        print(f"{c} streams, {name:22s}: {tok_s:8.1f} tok/s", flush=True)
    out = {"tp": args.tp, "tokens": args.tokens, "threads": args.threads, "streams": c, "adapters": args.adapters,
           "lora_rank": args.lora_rank, "prefix_cache": args.prefix_cache, "tokens_per_s": best,
           "mixed_over_one_adapter": best["mixed"] / best["one_adapter"],
           "mixed_over_one_adapter_per_batch": best["mixed"] / best["one_adapter_per_batch"],
           "one_adapter_over_base": best["one_adapter"] / best["base"]}
    print(f"mixed / one adapter: {out['mixed_over_one_adapter']:.2f} (goal >= 0.8); mixed / one adapter per "
          f"batch: {out['mixed_over_one_adapter_per_batch']:.2f}; one adapter / base: {out['one_adapter_over_base']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-serve-bench"))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream (64)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--repeats", type=int, default=8, help="rounds at one stream (8)")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per rank, engine and server alike (1: leaves a core for gRPC and the client)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), help="serve in this dtype, engine and server alike "
                    "(default: the checkpoint's, fp32)")
    ap.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="server and engine prefill every prompt in full (default: prefix reuse on, as served)")
    ap.add_argument("--unique-prompts", action="store_true",
                    help="make every request's prompt distinct, so that only the chat template's system prompt "
                         "is shared (default: the 4 prompts repeat, as retries and shared prompts do)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--adapters", type=int, metavar="N",
                    help="instead: the many-adapters comparison over N adapters (see above)")
    ap.add_argument("--lora-rank", type=int, default=16, help="rank of the --adapters adapters (16)")
    args = ap.parse_args()
    if args.adapters:
        run_adapters(args, prepare(args.workdir, args.tp))
        return
    from serve.client import Client
    from serve.client.local import LocalServer
    from tprt.distributed.launcher import launch_local

    model = prepare(args.workdir, args.tp)
    max_batch = max(args.streams)

    def run_engine(when: str) -> dict[str, float]:
        res: dict[str, float] = launch_local(args.tp, engine_rank, (str(model), PROMPTS[0], args.tokens, max_batch,
                                                                    args.max_seq_len, args.repeats, args.dtype,
                                                                    args.prefix_cache, args.unique_prompts),
                                            timeout_s=900,
                                            threads_per_rank=args.threads)[0]
        print(f"in-process engine ({when}), 1 stream: {res['tokens_per_s']:.1f} tok/s, "
              f"TTFT {res['ttft_s'] * 1e3:.0f} ms", flush=True)
        return res

    # TP 1: the peer lives in this process and its runs alternate with the server's, so load
    # drift on a shared machine does not favour either side. TP > 1: measured before and after.
    peer, engine = None, {}
    if args.tp == 1:
        import torch

        torch.set_num_threads(args.threads)
        peer = EnginePeer(str(model), max_batch, args.max_seq_len, args.dtype, args.prefix_cache)
        peer.unique = args.unique_prompts
        peer.measure(PROMPTS[0], 8)  # warm-up
    else:
        engine = run_engine("before")
    server = LocalServer(["--model", str(model), "--metrics-port", "-1", "--data-dir", str(args.workdir / "data"),
                          "--max-batch-size", str(max_batch), "--max-queue", str(max_batch), "--max-seq-len",
                          str(args.max_seq_len), "--threads", str(args.threads), "--log-level", "warning",
                          *(["--dtype", args.dtype] if args.dtype else []),
                          *([] if args.prefix_cache else ["--no-prefix-cache"])], args.workdir / "server.log")
    rows = []
    pairs: list[float] = []  # server / engine tokens/s of back-to-back runs (TP 1)
    try:
        with Client(server.target) as client:
            round_of(client, 1, 8)  # warm-up
            for c in args.streams:
                runs = []
                for _ in range(args.repeats if c == 1 else 3):
                    if peer is not None and c == 1:
                        e = peer.measure(PROMPTS[0], args.tokens)
                        engine = max(engine, e, key=lambda r: r["tokens_per_s"]) if engine else e
                    runs.append(round_of(client, c, args.tokens, args.unique_prompts))
                    if peer is not None and c == 1:
                        pairs.append(runs[-1]["tokens_per_s"] / e["tokens_per_s"])
                row = max(runs, key=lambda r: r["tokens_per_s"])
                rows.append(row)
                print(f"server, {c:3d} streams: {row['tokens_per_s']:8.1f} tok/s  TTFT p50 "
                      f"{row['ttft_p50_s'] * 1e3:7.0f} ms  p99 {row['ttft_p99_s'] * 1e3:7.0f} ms  "
                      f"prompt tokens reused {row['prompt_reused'] * 100:3.0f}%", flush=True)
    finally:
        server.stop()
    if peer is not None and 16 in args.streams:
        engine16 = max((peer.measure(PROMPTS[0], args.tokens, 16) for _ in range(3)), key=lambda r: r["tokens_per_s"])
        print(f"in-process engine, 16 streams: {engine16['tokens_per_s']:.1f} tok/s "
              f"({engine16['tokens_per_s'] / engine['tokens_per_s']:.1f}x its 1 stream)")
        engine["tokens_per_s_16"] = engine16["tokens_per_s"]
    if peer is None:
        after = run_engine("after")
        engine = max(engine, after, key=lambda r: r["tokens_per_s"])
    print(f"in-process engine, 1 stream: {engine['tokens_per_s']:.1f} tok/s, TTFT {engine['ttft_s'] * 1e3:.0f} ms")
    report(rows, engine, pairs, args)


def report(rows: list[dict[str, float]], engine: dict[str, float], pairs: list[float],
           args: argparse.Namespace) -> None:
    by = {int(r["streams"]): r for r in rows}
    out: dict[str, Any] = {"tp": args.tp, "tokens": args.tokens, "threads": args.threads, "dtype": args.dtype,
                           "prefix_cache": args.prefix_cache, "unique_prompts": args.unique_prompts,
                           "engine_1": engine,
                           "server": rows, "paired_ratios": pairs}
    if 1 in by:
        overhead = 1 - by[1]["tokens_per_s"] / engine["tokens_per_s"]
        out["grpc_overhead"] = overhead
        print(f"gRPC overhead at 1 stream (best of each): {overhead * 100:.1f}% (target < 5%)")
    if pairs:
        out["grpc_overhead_paired_median"] = 1 - statistics.median(pairs)
        print(f"gRPC overhead at 1 stream (median of {len(pairs)} back-to-back pairs): "
              f"{out['grpc_overhead_paired_median'] * 100:.1f}%")
    if 1 in by and 16 in by:
        out["scale_16_over_1"] = by[16]["tokens_per_s"] / by[1]["tokens_per_s"]
        print(f"16 streams / 1 stream throughput: {out['scale_16_over_1']:.1f}x (target >= 6x)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
