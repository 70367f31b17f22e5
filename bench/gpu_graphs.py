"""The engine's CUDA graphs checked on a GPU: the same tokens with and without them, in every step
shape they cover, no host synchronisation per layer, and what they save (needs CUDA; on CPU
`--device cpu` runs the same scenarios on eager static steps, as the tests do).

    python bench/gpu_graphs.py [--config bench/configs/llama-3.1-8b/config.json] [--layers 4]
                               [--weight-dtype int8|fp8] [--out FILE] [--trace DIR] [--device cuda|cpu]

Random weights of the config's shapes (its first `--layers` layers), float32 (random weights
give logits with near-ties, and bf16 rounding differences between two kernel schedules could
then flip a greedy choice without anything being wrong; bf16 with `--weight-dtype fp8`, whose
products are torch._scaled_mm with activations quantized per row inside the graph). Scenarios,
each through an Engine with `--cuda-graphs all` (tprt.engine.step_graphs) and one with graphs off:

- plain: uneven prompts, sequences joining and leaving, batches that are not a bucket size,
  steps over 256 and 512 keys;
- adapters: the same prompts routed to four LoRA adapters and the base model in one batch;
- speculative: prompt-lookup drafts (k = 4) on repetitive prompts: verifying rows of up to 5 tokens.

Each passes when graphs were captured and replayed (none failed) and both runs give the same
tokens; its seconds with and without graphs are reported. On CUDA it also counts the host
synchronisations of one eager decode step (torch.cuda.set_sync_debug_mode: the copies of the
step's inputs, none per layer) and of one replayed step (none), and profiles both steps (kernel
launches against one graph launch; `--trace DIR` keeps the Chrome traces). Exit status 1 with
the reason when anything fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tprt  # noqa: E402, F401 - before torch
import torch  # noqa: E402

from bench.gpu_bench import random_model  # noqa: E402
from tprt.distributed.context import TPContext  # noqa: E402
from tprt.engine.core import Engine, EngineConfig, run_to_completion  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402
from tprt.engine.speculative import SpeculativeConfig  # noqa: E402
from tprt.model.batch import BatchRow, TokenBatch  # noqa: E402
from tprt.model.llama import TPLlamaForCausalLM  # noqa: E402

PROMPTS = (37, 5, 300, 64, 9)  # prompt lengths (300: steps over 512 keys, the others 256)
NEW = (12, 30, 7, 20, 16)  # tokens each generates
ADAPTERS = ((("q", "v", "down"), 16), (("k", "o"), 8), (("gate", "up"), 16),
            (("q", "k", "v", "o", "gate", "up", "down"), 8))


def install_adapters(engine: Engine) -> None:
    """Four LoRA adapters (different targets and ranks, B non-zero) under indices 1-4."""
    from tprt.lora.attach import build_lora

    model = engine.runner.model
    for index, (targets, rank) in enumerate(ADAPTERS, start=1):
        adapter = build_lora(model, targets, rank, 2.0 * rank, seed=index)
        gen = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for _, module in adapter.pieces:
                for b in module.lora_B.values():
                    b.copy_((torch.randn(b.shape, generator=gen) * 0.05).to(b.device, b.dtype))
        engine.runner.adapters.install(index, adapter)


def prompt(i: int, n: int, vocab: int, repetitive: bool = False) -> list[int]:
    if repetitive:  # a phrase of 7 tokens over and over: prompt lookup finds it
        return [(i * 131 + (k % 7) * 17) % vocab for k in range(n)]
    return [(i * 131 + k * 17) % vocab for k in range(n)]


def run(model: TPLlamaForCausalLM, graphs: str, scenario: str) -> tuple[dict[str, list[int]], Engine, float]:
    spec = SpeculativeConfig("ngram", num_tokens=4, min_n=1, max_n=3, adaptive=False, max_step_tokens=1024) \
        if scenario == "speculative" else None
    engine = Engine(model, None, EngineConfig(max_batch=8, max_seq_len=1024, token_budget=64, cuda_graphs=graphs,
                                              speculative=spec))
    if scenario == "adapters":
        install_adapters(engine)
    for i, (n, new) in enumerate(zip(PROMPTS, NEW)):
        engine.add(prompt(i, n, model.config.vocab_size, scenario == "speculative"),
                   SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True), str(i),
                   adapter=i % 5 if scenario == "adapters" else 0)
    sync(model)
    t0 = time.perf_counter()
    done = run_to_completion(engine)
    sync(model)
    seconds = time.perf_counter() - t0
    engine.close()
    if scenario == "adapters":  # the next engine's slots install their own
        from tprt.lora.method import unwrap

        for linear in model.linears():
            unwrap(linear)
    return {rid: c.token_ids for rid, c in done.items()}, engine, seconds


def sync(model: TPLlamaForCausalLM) -> None:
    if model.tp.device.type == "cuda":
        torch.cuda.synchronize(model.tp.device)


def scenario_result(model: TPLlamaForCausalLM, scenario: str) -> dict[str, Any]:
    run(model, "all", scenario)  # warm-up: captures, compiles the kernels
    graphed, engine, graphed_s = run(model, "all", scenario)
    eager, _, eager_s = run(model, "off", scenario)
    graphs = engine.runner.graphs
    assert graphs is not None
    keys = sorted(graphs.graphs)
    return {"graphs": [f"{k.tokens} tokens, rows <= {k.width}, {k.adapters} adapters"
                       + (f", {k.kv_len} keys" if k.kv_len else "") for k in keys],
            "widest_row": max((k.width for k in keys), default=0),
            "most_adapters": max((k.adapters for k in keys), default=0),
            "capture_failed": graphs.failed, "same_tokens": graphed == eager,
            "graphs_s": round(graphed_s, 4), "eager_s": round(eager_s, 4), "speedup": round(eager_s / graphed_s, 2)}


def decode_batch(engine: Engine, rows: int, start: int) -> TokenBatch:
    """A decode step of `rows` one-token rows at position `start`, each in its own blocks."""
    size = engine.config.kv_block_size
    per_row = -(-(start + 1) // size)
    return TokenBatch.of([BatchRow(tuple(range(1 + r * per_row, 1 + (r + 1) * per_row)), start, (7,), 1)
                          for r in range(rows)])


def step_costs(model: TPLlamaForCausalLM, trace: Path | None) -> dict[str, Any]:
    """Host synchronisations and launches of one decode step of 8 rows, eager and replayed."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    for graphs in ("off", "all"):
        engine = Engine(model, None, EngineConfig(max_batch=8, max_seq_len=1024, cuda_graphs=graphs))
        batch = decode_batch(engine, 8, 300)
        step: Callable[[], Any] = lambda: engine.runner.execute(batch)  # noqa: E731
        step()
        step()  # captured, then replayed once
        sync(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync(model)
        names = [e.name for e in prof.events()]
        out[graphs] = {"host_syncs": len(syncs), "sync_ops": sorted(set(syncs))[:5],
                       "kernel_launches": sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
                                              for n in names),
                       "graph_launches": sum(n == "cudaGraphLaunch" for n in names)}
        if trace is not None:
            trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace / f"decode-step-graphs-{graphs}.json"))
        engine.close()
    out["layers"] = model.config.num_hidden_layers
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "bench" / "configs" / "llama-3.1-8b" / "config.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--trace", type=Path, metavar="DIR", help="CUDA: keep the profiler's Chrome traces here")
    ap.add_argument("--weight-dtype", choices=("int8", "fp8"), help="quantize the linear weights first")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the scenarios on eager static steps (no graphs, no sync or launch counts)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_graphs.py: no CUDA device (--device cpu runs the scenarios eagerly)")
    dtype = torch.bfloat16 if args.weight_dtype == "fp8" else torch.float32  # _scaled_mm takes bf16 activations
    model = random_model(args.config, TPContext.single(args.device), dtype, num_layers=args.layers)
    if args.weight_dtype is not None:
        from tprt.quant.formats import QuantSpec
        from tprt.quant.methods import quantize_linears

        quantize_linears(model, QuantSpec(args.weight_dtype))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                           "weight_dtype": args.weight_dtype or "dense"}
    failures = []
    for scenario in ("plain", "adapters", "speculative"):
        result = out[scenario] = scenario_result(model, scenario)
        if result["capture_failed"] or not result["graphs"]:
            failures.append(f"{scenario}: no CUDA graph was captured and replayed (see the warning above)")
        elif not result["same_tokens"]:
            failures.append(f"{scenario}: graph replay and eager steps gave different tokens")
    if out["speculative"]["widest_row"] < 2 or out["adapters"]["most_adapters"] < 4:
        failures.append("no graph of verifying rows, or none mixing four adapters")
    if args.device == "cuda":
        costs = out["steps"] = step_costs(model, args.trace)
        if costs["all"]["host_syncs"] or costs["off"]["host_syncs"] >= costs["layers"]:
            failures.append(f"host synchronisations per step: {costs['off']['host_syncs']} eager, "
                            f"{costs['all']['host_syncs']} replayed ({costs['layers']} layers)")
        if costs["all"]["graph_launches"] != 1:
            failures.append(f"a replayed step launched {costs['all']['graph_launches']} graphs, not 1")
    out["failures"] = failures
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if failures:
        sys.exit("gpu_graphs.py: FAIL: " + "; ".join(failures))


if __name__ == "__main__":
    main()
