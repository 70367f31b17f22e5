"""The paged KV cache against the slot cache it replaced, on the real SmolLM2-135M-Instruct, in one run.

    python bench/kv_bench.py --baseline /path/to/checkout-with-slots    # about 5-10 minutes on 2 cores

Each workload runs in a fresh process per implementation, alternating (baseline, ours, baseline,
ours, ... for --repeats): the baseline process imports tprt from --baseline (a checkout of the
code before the paged cache, e.g. `git worktree add ../base <commit>`), ours from this checkout.
Both use the same weights (bench/generate_bench.py's workdir), the same KV memory and the
engine's defaults otherwise (prefix caching on). Reported, per implementation:

- capacity: one KV budget (--budget positions, max_seq_len 1024) and 32 requests of a length mix
  (prompts of 100-600 tokens, 8-24 new tokens, seeded): the most sequences running at once and
  the throughput. The slot cache holds budget // max_seq_len sequences whatever their length; the
  paged one as many as their tokens fit.
- shared prefix: --streams N requests (32 and 64) with one --prefix-token system prompt and a
  short question each, all arriving at once; time to first token (median, max) and aggregate
  generated tokens/s (first token to last), greedy, 16 new tokens each.

Time is wall time: the machine may be shared, so compare implementations within a run.

    python bench/kv_bench.py --kv-dtypes bf16 int8 fp8 int8-static    # about 3-5 minutes on 2 cores

compares KV cache dtypes of this checkout instead (--kv-cache-dtype): the capacity workload with
the same KV memory for each, the bytes of --budget bf16 positions (int8/fp8: one byte per value
and a bfloat16 scale per head vector, so (2 * 64) / (64 + 2) = 1.94x the positions at SmolLM2's
head_dim 64), and the most sequences running at once in each; then the sequences held at once
(`held_peak_running`): 64 requests of one length (240 prompt tokens, 16 new) in the same memory,
where the count is set by the cache's bytes rather than by when requests come and go.
int8-static is int8 with static scales (`--kv-scales`, calibrated on bench/quant_text.txt): one
byte per value and nothing per token, 2x the positions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MAX_SEQ_LEN = 1024


def _engine(model_dir: Path, max_batch: int, max_seq_len: int, kv_tokens: int | None, kv_dtype: str = "auto") -> Any:
    """An engine over tp1 in this process's tprt (ours or the baseline's): the same KV memory
    either way (kv_tokens, or max_batch x max_seq_len). kv_dtype int8-static: int8 with static
    scales calibrated on bench/quant_text.txt (`tprt calibrate-kv`'s, margin 1.25)."""
    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import TPContext
    from tprt.engine.core import Engine, EngineConfig

    fields = EngineConfig.__dataclass_fields__
    kw: dict[str, Any] = {"max_batch": max_batch, "max_seq_len": max_seq_len}
    if kv_tokens is not None and "kv_cache_tokens" in fields:
        kw["kv_cache_tokens"] = kv_tokens
    model = load_model(model_dir, TPContext.single(), "fp32")
    if kv_dtype != "auto":  # this checkout only (--kv-dtypes)
        from tprt.model.kv_cache import kv_cache_dtype

        kw["cache_dtype"] = kv_cache_dtype(kv_dtype.removesuffix("-static"))
    if kv_dtype == "int8-static":
        from tprt.model.kv_scales import calibrate, scales_from_amax
        from tprt.text.tokenizer import Tokenizer

        ids = Tokenizer.from_dir(model_dir).encode((ROOT / "bench" / "quant_text.txt").read_text())
        kw["kv_scales"] = scales_from_amax(calibrate(model, [ids]))
    return Engine(model, None, EngineConfig(**kw), eos_token_ids=())


def _drive(engine: Any, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Adds every request at once and steps to the end: first-token times, the most sequences
    decoding in one step, generated tokens and the time from the first token to the last."""
    from tprt.engine.sampling import SamplingParams

    start = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), str(i))
    first: dict[str, float] = {}
    peak = tokens = 0
    while engine.has_work:
        events = engine.step()
        now = time.perf_counter()
        tokens += sum(e.token_id is not None for e in events)
        peak = max(peak, sum(1 for e in events if e.token_id is not None))
        for e in events:
            first.setdefault(e.request_id, now - start)
    end = time.perf_counter() - start
    ttft = sorted(first.values())
    return {"peak_running": peak, "tokens": tokens, "seconds": end, "tokens_per_s": tokens / (end - ttft[0]),
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": ttft[-1]}


def _capacity_requests(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randrange(100, 600))], rng.randrange(8, 25))
            for _ in range(32)]


HELD_LENGTH, HELD_NEW = 256, 16  # 16 blocks of 16 positions per sequence at the end


def _held_requests(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(HELD_LENGTH - HELD_NEW)], HELD_NEW) for _ in range(64)]


def _shared_requests(streams: int, prefix: int) -> list[tuple[list[int], int]]:
    system = [(i * 7919) % 40000 + 100 for i in range(prefix)]
    return [(system + [(s * 31 + k) % 40000 + 100 for k in range(12)], 16) for s in range(streams)]


def child(args: argparse.Namespace) -> None:
    """One workload in this process; prints one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    model_dir = args.workdir / "tp1"
    if args.workload.startswith("capacity-"):  # --kv-dtypes: the KV bytes of --budget bf16 positions
        import torch

        from tprt.model.kv_cache import kv_bytes_per_position, kv_cache_dtype

        kv = args.workload.removeprefix("capacity-")
        dtype, d = kv_cache_dtype(kv.removesuffix("-static")), 64  # SmolLM2's head_dim
        per_position = kv_bytes_per_position(dtype, d, static_scales=kv.endswith("-static"))
        tokens = int(args.budget * kv_bytes_per_position(torch.bfloat16, d) // per_position)
        result = {"kv_cache_tokens": tokens, **_drive(_engine(model_dir, 64, MAX_SEQ_LEN, tokens, kv), _capacity_requests())}
        # Held at once: 64 sequences of one length (HELD_LENGTH positions, HELD_NEW of them
        # generated), so the count is set by the memory, not by when a mixed workload's
        # requests arrive and finish.
        held = _drive(_engine(model_dir, 64, MAX_SEQ_LEN, tokens, kv), _held_requests())
        result["held_peak_running"] = held["peak_running"]
    elif args.workload == "capacity":
        slots = args.budget // MAX_SEQ_LEN
        paged = "kv_cache_tokens" in _engine_fields()
        # The slot cache: budget // max_seq_len sequences; the paged one: as many as fit (up to 64).
        engine = _engine(model_dir, 64 if paged else slots, MAX_SEQ_LEN, args.budget)
        result = _drive(engine, _capacity_requests())
    else:
        streams = int(args.workload.removeprefix("shared"))
        engine = _engine(model_dir, streams, args.prefix + 32, None)
        result = _drive(engine, _shared_requests(streams, args.prefix))
    print(json.dumps(result))


def _engine_fields() -> dict[str, Any]:
    from tprt.engine.core import EngineConfig

    return EngineConfig.__dataclass_fields__


def _run(root: Path, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", workload, "--workdir", str(args.workdir),
               "--budget", str(args.budget), "--prefix", str(args.prefix), "--threads", str(args.threads)]
    out = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{workload} under {root} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a checkout of the slot-cache code (required unless --child)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-generate-bench"),
                    help="bench/generate_bench.py's workdir (SmolLM2 converted; made when missing)")
    ap.add_argument("--budget", type=int, default=8192, help="KV positions for the capacity workload (8192)")
    ap.add_argument("--prefix", type=int, default=1000, help="shared system prompt tokens (1000)")
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs per implementation (1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared machine more threads than free cores stall every op)")
    ap.add_argument("--kv-dtypes", nargs="+", metavar="DTYPE",
                    help="compare these --kv-cache-dtype values of this checkout at the same KV memory instead")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.workload = args.child
        child(args)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from generate_bench import prepare

    if args.kv_dtypes:
        prepare(args.workdir, (1,))
        kv_report: dict[str, Any] = {"budget_bf16_positions": args.budget, "max_seq_len": MAX_SEQ_LEN,
                                     "load_average_before": os.getloadavg()}
        for kv in args.kv_dtypes:
            kv_report[kv] = _run(ROOT, f"capacity-{kv}", args)
            print(kv, json.dumps(kv_report[kv]), file=sys.stderr)
        if "bf16" in kv_report:
            kv_report["peak_running_vs_bf16"] = {kv: kv_report[kv]["peak_running"] / kv_report["bf16"]["peak_running"]
                                                 for kv in args.kv_dtypes}
            kv_report["held_vs_bf16"] = {kv: kv_report[kv]["held_peak_running"] / kv_report["bf16"]["held_peak_running"]
                                         for kv in args.kv_dtypes}
        kv_report["load_average_after"] = os.getloadavg()
        print(json.dumps(kv_report, indent=1))
        return
    if args.baseline is None:
        ap.error("--baseline or --kv-dtypes is required")
    prepare(args.workdir, (1,))
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    report: dict[str, Any] = {"budget": args.budget, "max_seq_len": MAX_SEQ_LEN, "prefix": args.prefix}
    for workload in ["capacity", *(f"shared{n}" for n in args.streams)]:
        runs: dict[str, list[dict[str, Any]]] = {"slots": [], "paged": []}
        for _ in range(args.repeats):
            runs["slots"].append(_run(args.baseline.resolve(), workload, args))
            runs["paged"].append(_run(ROOT, workload, args))
        report[workload] = runs
        print(workload, json.dumps(runs), file=sys.stderr)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
