"""Generation over pipeline stages: a step's micro-batches against the whole model (issue 44).

    python bench/pp_generate_bench.py [--pp 2] [--micro 1,2,4] [--rows 8] [--prompt 64] [--new 32]

A random Llama (hidden 512, 8 layers, fp32) in --pp stages of TP 1, one rank and one thread per
stage on this machine. --rows greedy requests of --prompt tokens each generate --new tokens
through the engine (tprt.engine.stage_runner). First with one step in flight, each step's rows
passed along the stages in m micro-batches, for each m of --micro: the model's time for p stages
is then W / p x (m + p - 1) / m, W being the same requests' time through the whole model on one
rank (one thread, eager like the stages): each stage does 1/p of the work, and the pipeline
fills and drains once a step. Then with the engine's defaults ("default"): one step in flight
per stage, and steps of 256+ tokens per micro-batch split (at most 4 per stage). Printed: the
measured time, the model's, and the speed-up over the whole model.

Not part of CI: figures go to docs/PERF.md.
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
from pp_bench import SHAPE, prepare  # noqa: E402 - the same model


def _requests(rows: int, prompt: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, SHAPE["vocab_size"], (prompt,), generator=g).tolist() for _ in range(rows)]


def _time(engine: object, prompts: list[list[int]], new: int, repeats: int) -> float:
    """Median seconds of generating for every prompt (rank 0; the others follow)."""
    from tprt.engine.core import Engine, run_to_completion
    from tprt.engine.sampling import SamplingParams

    assert isinstance(engine, Engine)
    times = []
    for r in range(repeats + 1):
        for i, p in enumerate(prompts):
            engine.add(p, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True), f"{r}-{i}")
        t0 = time.perf_counter()
        run_to_completion(engine)
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank(tp1: Path, pp: int, micro: list[int], rows: int, prompt: int, new: int, repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    from tprt.checkpoint.loading import load_model, load_stage
    from tprt.distributed.context import TPContext
    from tprt.distributed.pipeline_mesh import init_pipeline
    from tprt.engine.core import Engine, EngineConfig
    from tprt.parallel.stages import stages

    torch.set_num_threads(1)
    mesh = init_pipeline(1, pp)
    prompts = _requests(rows, prompt)
    out: dict[str, float] = {}
    base = dict(max_batch=rows, max_seq_len=prompt + new, token_budget=rows * prompt, cpu_prepack=False,
                prefix_cache=False)  # every repeat prefills its prompts again
    if mesh.tp.global_rank == 0:  # the whole model alone, on one rank and thread
        whole = Engine(load_model(tp1, TPContext.single(), "fp32"), None, EngineConfig(**base), eos_token_ids=[])
        out["whole"] = _time(whole, prompts, new, repeats)
    dist.barrier()
    model = load_stage(tp1, mesh.tp, stages(SHAPE["num_hidden_layers"], pp)[mesh.stage_index], "fp32")
    for m in micro:  # 0: the defaults
        config = EngineConfig(**base, pipeline_microbatches=m or None, pipeline_steps_in_flight=1 if m else None)
        engine = Engine(model, None, config, eos_token_ids=[], pipeline=mesh)
        if engine.is_driver:
            with engine:
                out[f"m{m}"] = _time(engine, prompts, new, repeats)
        else:
            engine.follow()
        dist.barrier()
    return out


def main() -> None:
    from tprt.distributed.launcher import launch_local

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--micro", default="1,2,4")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    micro = [*(int(x) for x in a.micro.split(",")), 0]  # 0: the engine's defaults
    r = launch_local(a.pp, rank, (prepare(), a.pp, micro, a.rows, a.prompt, a.new, a.repeats), timeout_s=1800)[0]
    whole = r["whole"]
    print(f"random Llama {SHAPE}, fp32, PP {a.pp} x TP 1 (one rank and thread per stage); {a.rows} greedy requests "
          f"of {a.prompt} prompt tokens, {a.new} new tokens each; whole model on one rank: {whole * 1e3:.0f} ms")
    print(f"{'m':>7} | {'measured ms':>11} | {'model ms':>8} | {'measured/model':>14} | {'speed-up vs whole':>17}")
    for m in micro:
        got = r[f"m{m}"]
        if not m:  # the defaults: steps in flight, m per step
            print(f"{'default':>7} | {got * 1e3:11.0f} | {'-':>8} | {'-':>14} | {whole / got:17.2f}")
            continue
        model = whole / a.pp * (m + a.pp - 1) / m
        print(f"{m:>7} | {got * 1e3:11.0f} | {model * 1e3:8.0f} | {got / model:14.2f} | {whole / got:17.2f}")


if __name__ == "__main__":
    main()
