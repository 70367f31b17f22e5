"""The CUDA-graph decode path, checked on a GPU (needs CUDA; not run in CI).

    python bench/gpu_graphs.py [--config bench/configs/llama-3.1-8b/config.json] [--layers 4] [--out FILE]
                               [--weight-dtype int8|fp8]

Random float32 weights of the config's shapes (its first `--layers` layers) on the GPU (float32:
random weights give logits with near-ties, and bf16 rounding differences between two kernel
schedules could then flip a greedy choice without anything being wrong); the same
greedy requests (uneven prompts, sequences joining and leaving, batches that are not a bucket
size, steps over 256 and 512 keys) through an Engine with static decode (tprt.engine.static_decode: one CUDA graph per batch
bucket) and through one without. Passes when graphs were captured and replayed (none failed)
and both give the same tokens. Exit status 1 otherwise, with the reason. With --weight-dtype the
decoder's linear layers are quantized first (tprt.quant; fp8 in bf16: torch._scaled_mm with
activations quantized per row inside the graph).
"""

from __future__ import annotations

import argparse
import json
import sys
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
from tprt.model.llama import TPLlamaForCausalLM  # noqa: E402

PROMPTS = (37, 5, 300, 64, 9)  # prompt lengths (300: steps over 512 keys, the others 256)
NEW = (12, 30, 7, 20, 16)  # tokens each generates


def generate(model: TPLlamaForCausalLM, static: bool) -> tuple[dict[str, list[int]], Engine]:
    engine = Engine(model, None, EngineConfig(max_batch=8, max_seq_len=1024, token_budget=64, static_decode=static))
    for i, (n, new) in enumerate(zip(PROMPTS, NEW)):
        ids = [(i * 131 + k * 17) % model.config.vocab_size for k in range(n)]
        engine.add(ids, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True), str(i))
    done = run_to_completion(engine)
    engine.close()
    return {rid: c.token_ids for rid, c in done.items()}, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "bench" / "configs" / "llama-3.1-8b" / "config.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--weight-dtype", choices=("int8", "fp8"), help="quantize the linear weights first")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_graphs.py: no CUDA device")
    dtype = torch.bfloat16 if args.weight_dtype == "fp8" else torch.float32  # _scaled_mm takes bf16 activations
    model = random_model(args.config, TPContext.single("cuda"), dtype, num_layers=args.layers)
    if args.weight_dtype is not None:
        from tprt.quant.formats import QuantSpec
        from tprt.quant.methods import quantize_linears

        quantize_linears(model, QuantSpec(args.weight_dtype))
    graphed, engine = generate(model, static=True)
    eager, _ = generate(model, static=False)
    static = engine.runner.static
    assert static is not None
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "weight_dtype": args.weight_dtype or "dense",
                           "captured_batch_kv_buckets": sorted(static.graphs),
                           "capture_failed": static.failed, "same_tokens": graphed == eager}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if static.failed or not static.graphs:
        sys.exit("gpu_graphs.py: FAIL: no CUDA graph was captured and replayed (see the warning above)")
    if graphed != eager:
        sys.exit("gpu_graphs.py: FAIL: graph replay and eager decode gave different tokens")


if __name__ == "__main__":
    main()
