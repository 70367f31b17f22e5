"""The engine's step, before and after a change, on the real SmolLM2-135M-Instruct: one script
runs the same workloads through each tree's engine in turn, alternated, so a noisy machine hits
both alike.

    git worktree add /tmp/before <commit>
    python bench/step_bench.py --trees /tmp/before . --rounds 2

Each (round, tree) runs this file's `--worker` in a fresh process with the tree's tprt on the
path; the worker uses only the engine's public API (Engine, EngineConfig, SamplingParams,
run_to_completion), which both trees have. Workloads (greedy, EOS ignored, threads `--threads`):

- batch-1 decode tokens/s in fp32, bf16 and int8 weights (`hf-to-tp --quantize int8`);
- 16 sequences decoding together (fp32): aggregate tokens/s;
- speculative decoding (ngram, k 4) on bench/spec_prompts.json's grounded prompts (fp32): tokens/s;
- constrained decoding (a JSON schema, bf16): batch-1 tokens/s;
- the host's time per step at batch 1 and 64 (fp32): the step's wall time outside the decoder
  layers and the LM head (scheduling, batch building, attention set-up, sampling, events; the
  embedding, the same in both), mean per step.

Reported per tree: the best of its rounds, and after / before ratios (each should be >= 0.97).
`--only NAME ...` runs just those workloads (e.g. `--only spec_grounded_fp32` to recheck one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "items": {"type": "array", "items":
          {"type": "object", "properties": {"id": {"type": "integer"}, "note": {"type": "string"}}}}},
          "required": ["name", "items"]}


def prepare(workdir: Path) -> None:
    """SmolLM2 at TP 1 in fp32/bf16 weights and int8 (this tree's converter; both trees read it)."""
    from convert.api import gguf_to_hf, hf_to_tp
    from tprt.cli.demo import smollm2_gguf

    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "hf" / "config.json").exists():
        gguf_to_hf(smollm2_gguf(), workdir / "hf")
    if not (workdir / "tp1" / "tprt_manifest.json").exists():
        hf_to_tp(workdir / "hf", workdir / "tp1", 1)
    if not (workdir / "int8" / "tprt_manifest.json").exists():
        hf_to_tp(workdir / "hf", workdir / "int8", 1, quantize="int8")


def _rate(engine: Any, prompts: list[list[int]], new: int, params: dict[str, Any] | None = None,
          repeats: int = 3) -> float:
    """Aggregate decode tokens/s: the best time of `new` tokens less the best of 2 (prefill and
    first token), of `repeats` runs each."""
    from tprt.engine.core import run_to_completion
    from tprt.engine.sampling import SamplingParams

    def run(n: int) -> float:
        for i, p in enumerate(prompts):
            engine.add(p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **(params or {})), str(i))
        start = time.perf_counter()
        run_to_completion(engine)
        return time.perf_counter() - start

    run(4)  # warm-up
    return len(prompts) * (new - 2) / (min(run(new) for _ in range(repeats)) - min(run(2) for _ in range(repeats)))


class _Timed:
    """A callable of the model, timed: the decoder stack (what runs the layers) and the LM head's
    forward, the same objects in both trees."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        out = self.fn(*a, **kw)
        self.seconds += time.perf_counter() - start
        return out


def _host_ms(engine: Any, model: Any, prompts: list[list[int]], new: int) -> float:
    """Mean per decode step of the engine's wall time outside the decoder layers and the LM head,
    in ms: its Python (scheduling, batch building, attention set-up, sampling, events) and the
    embedding, the same work in both trees."""
    from tprt.engine.sampling import SamplingParams

    for i, p in enumerate(prompts):
        engine.add(p, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True), str(i))
    while engine.has_work:  # prefill and first tokens, untimed
        engine.step()
        running = engine.scheduler.running
        if running and not engine.scheduler.waiting and all(s.output for s in running):
            break
    stack = model.stack = _Timed(model.stack)
    head = model.lm_head.forward = _Timed(model.lm_head.forward)
    steps, start = 0, time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    total = time.perf_counter() - start
    model.stack = stack.fn
    del model.lm_head.forward  # the class's again
    return 1000 * (total - stack.seconds - head.seconds) / steps


def worker(workdir: Path, threads: int, only: set[str] | None = None) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import TPContext
    from tprt.engine.constraints import ConstraintSpec
    from tprt.engine.core import Engine, EngineConfig
    from tprt.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(workdir / "hf")
    prompt = tok.encode_chat([{"role": "user", "content": "Tell me about lighthouses."}])
    out: dict[str, float] = {}

    def engine(path: str, dtype: str, **kw: Any) -> tuple[Any, Any]:
        model = load_model(workdir / path, TPContext.single(), dtype)
        return Engine(model, tok, EngineConfig(max_seq_len=512, **kw), eos_token_ids=()), model

    def wanted(*names: str) -> bool:
        return only is None or bool(only & set(names))

    for name, path, dtype in (("b1_fp32", "tp1", "fp32"), ("b1_bf16", "tp1", "bf16"), ("b1_int8", "int8", "bf16")):
        if wanted(name):
            e, _ = engine(path, dtype, max_batch=1)
            out[name] = _rate(e, [prompt], 64)
    if wanted("b16_fp32", "host_ms_b1", "host_ms_b64"):
        e, model = engine("tp1", "fp32", max_batch=64)
        out["b16_fp32"] = _rate(e, [prompt] * 16, 24)
        out["host_ms_b1"] = min(_host_ms(e, model, [prompt], 32) for _ in range(3))
        out["host_ms_b64"] = min(_host_ms(e, model, [prompt] * 64, 12) for _ in range(2))
    if wanted("spec_grounded_fp32"):
        out["spec_grounded_fp32"] = _spec_rate(engine, tok)
    if wanted("constrained_bf16"):
        e, _ = engine("tp1", "bf16", max_batch=1)
        spec = ConstraintSpec.json_schema(SCHEMA, "schema")
        e.structured_outputs.compile(spec)
        ask = tok.encode_chat([{"role": "user", "content": "A shopping list as JSON."}])
        out["constrained_bf16"] = _rate_constrained(e, ask, spec)
    return out


def _spec_rate(engine: Any, tok: Any) -> float:
    """Speculative decoding (ngram, k 4) on six grounded prompts: tokens/s."""
    from tprt.engine.speculative import SpeculativeConfig

    grounded = [tok.encode_chat([{"role": "user", "content": p}])
                for p in json.loads((ROOT / "bench" / "spec_prompts.json").read_text())["grounded"][:6]]
    e, _ = engine("tp1", "fp32", max_batch=1, speculative=SpeculativeConfig("ngram", num_tokens=4))
    start, tokens = time.perf_counter(), 0
    from tprt.engine.core import run_to_completion
    from tprt.engine.sampling import SamplingParams

    for i, p in enumerate(grounded):
        e.add(p, SamplingParams(temperature=0.0, max_new_tokens=48), str(i))
        tokens += sum(len(c.token_ids) for c in run_to_completion(e).values())
    return tokens / (time.perf_counter() - start)


def _rate_constrained(engine: Any, prompt: list[int], spec: Any) -> float:
    from tprt.engine.core import run_to_completion
    from tprt.engine.sampling import SamplingParams

    best = 0.0
    for _ in range(2):
        engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=64, constraint=spec), "c")
        start = time.perf_counter()
        done = run_to_completion(engine)["c"]
        best = max(best, len(done.token_ids) / (time.perf_counter() - start))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", type=Path, default=[ROOT], help="checkouts to compare, first = before")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-step-bench"))
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these workloads (their names as printed)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.workdir, args.threads, set(args.only) if args.only else None)))
        return
    sys.path.insert(0, str(ROOT))
    prepare(args.workdir)
    results: dict[Path, list[dict[str, float]]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": f"{tree.resolve()}:{ROOT / 'tests'}"}
            only = ["--only", *args.only] if args.only else []
            proc = subprocess.run([sys.executable, __file__, "--worker", "--workdir", str(args.workdir),
                                   "--threads", str(args.threads), *only], env=env, cwd=tree, capture_output=True,
                                  text=True, timeout=1800)
            if proc.returncode:
                sys.exit(f"{tree}: {proc.stderr[-2000:]}")
            results[tree].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {tree}: {results[tree][-1]}", file=sys.stderr, flush=True)
    best = {t: {k: (min if k.startswith("host") else max)(run[k] for run in runs) for k in runs[0]}
            for t, runs in results.items()}
    before = best[args.trees[0]]
    for tree in args.trees:
        cells = []
        for k, v in best[tree].items():
            ratio = (before[k] / v) if k.startswith("host") else (v / before[k])
            cells.append(f"{k} {v:.2f} ({ratio:.2f}x)")
        print(f"{tree}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
