"""Prefill with sequence parallelism against without, in one run (issue 44).

    python bench/sp_prefill_bench.py [--tp 2] [--rows 4] [--prompt 512] [--repeats 3]

The random Llama of bench/pp_bench.py (hidden 512, 8 layers, fp32) at --tp ranks on this machine
prefills --rows prompts of --prompt tokens (one new token each) through the engine, with
`sequence_parallel_tokens` 0 (every block ends in an all-reduce: on CPU tprt's shared-memory one)
and 64 (reduce-scatter and all-gather through gloo, the norms and residuals on 1/TP of the
tokens). Prints both medians and their ratio. Not part of CI: figures go to docs/PERF.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import tprt  # noqa: F401 - before torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pp_bench import CACHE, SHAPE, prepare  # noqa: E402 - the same model


def rank(tp_dir: Path, rows: int, prompt: int, repeats: int) -> dict[int, float]:
    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import init_distributed
    from tprt.engine.core import Engine, EngineConfig, run_to_completion
    from tprt.engine.sampling import SamplingParams

    torch.set_num_threads(1)
    ctx = init_distributed()
    model = load_model(tp_dir, ctx, "fp32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (prompt,), generator=g).tolist() for _ in range(rows)]
    out: dict[int, float] = {}
    for tokens in (0, 64, 0, 64):  # interleaved: the machine's noise falls on both
        config = EngineConfig(max_batch=rows, max_seq_len=prompt + 1, token_budget=rows * prompt,
                              prefix_cache=False, sequence_parallel_tokens=tokens)
        engine = Engine(model, None, config, eos_token_ids=[])
        if not engine.is_driver:
            engine.follow()
            continue
        times = []
        with engine:
            for r in range(repeats + 1):
                for i, p in enumerate(prompts):
                    engine.add(p, SamplingParams(temperature=0.0, max_new_tokens=1), f"{r}-{i}")
                t0 = time.perf_counter()
                run_to_completion(engine)
                if r:
                    times.append(time.perf_counter() - t0)
        out[tokens] = min(out.get(tokens, float("inf")), statistics.median(times))
    return out


def main() -> None:
    from convert import api
    from tprt.distributed.launcher import launch_local

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    prepare()
    tp_dir = CACHE / f"llama-tp{a.tp}"
    if not tp_dir.exists():
        api.hf_to_tp(CACHE / "llama-hf", tp_dir, a.tp)
    r = launch_local(a.tp, rank, (tp_dir, a.rows, a.prompt, a.repeats), timeout_s=1800)[0]
    print(f"random Llama {SHAPE}, fp32, TP {a.tp} (one thread per rank); {a.rows} prompts of {a.prompt} tokens "
          "prefilled in one step")
    print(f"all-reduce (no SP): {r[0] * 1e3:.0f} ms | sequence-parallel: {r[64] * 1e3:.0f} ms | "
          f"SP / no SP: {r[64] / r[0]:.2f}")


if __name__ == "__main__":
    main()
