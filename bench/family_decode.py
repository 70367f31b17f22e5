"""Decode speed of the families beyond Llama against Llama of the same shapes, per weight byte.

    python bench/family_decode.py [--dtype fp32|bf16] [--batches 1,16] [--tokens 48] [--repeats 3]

Random weights of SmolLM2-135M's shapes (hidden 576, 30 layers, 9 heads, 3 kv heads, head_dim
64, vocab 49152, tied) as Llama, as Qwen2 (the same plus q/k/v biases), as Qwen3 (plus q/k
norms), as Mistral (a sliding window of 32) and as Gemma 2 and 3 (their blocks, windows of 32 on
their windowed layers), built in this process on the CPU and run by the engine at batch 1 and 16 (greedy,
`--tokens` new tokens each). Decode rates are differences of two run lengths (prefill and
start-up cancel out), best of `--repeats`, interleaved so the machine's noise hits every model
alike. Reported: tokens/s, weight bytes, and each family's tokens/s x weight bytes as a ratio
to Llama's (issue 41's goal: within 10%, i.e. >= 0.90). `--out FILE` writes the JSON too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tprt  # noqa: E402, F401 - before torch
import torch  # noqa: E402

from tprt.distributed.context import TPContext  # noqa: E402
from tprt.engine.core import Engine, EngineConfig, run_to_completion  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402
from bench.gpu_bench import random_model_of  # noqa: E402
from tprt.model.config import ModelConfig  # noqa: E402
from tprt.model.llama import TPLlamaForCausalLM  # noqa: E402

SHAPES: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                              tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
# family -> (architecture, model_type, its own fields): windows of 32 positions, shorter than the
# runs' sequences (16-token prompts and up to `--tokens` more), so windowed layers do window.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "llama", {}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {}),
    "mistral": ("MistralForCausalLM", "mistral", {"sliding_window": 32}),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", {"sliding_window": 32, "head_dim": 64}),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", {"sliding_window": 32, "head_dim": 64}),
}


def build(family: str, dtype: torch.dtype) -> TPLlamaForCausalLM:
    arch, model_type, extra = FAMILIES[family]
    cfg = ModelConfig.from_dict({**SHAPES, **extra, "architectures": [arch], "model_type": model_type}, family)
    return random_model_of(cfg, TPContext.single("cpu"), dtype)


def run(engine: Engine, batch: int, tokens: int) -> float:
    for i in range(batch):
        engine.add([(7 * i + k) % 1000 + 3 for k in range(16)],
                   SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True), f"r{i}")
    t0 = time.perf_counter()
    run_to_completion(engine)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES), help="which to run (llama always)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    families = ["llama"] + [f for f in args.families.split(",") if f in FAMILIES and f != "llama"]
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    engines = {}
    for family in families:
        model = build(family, dtype)
        engines[family] = (Engine(model, None, EngineConfig(max_batch=16, max_seq_len=256), eos_token_ids=()),
                           sum(p.nbytes for p in model.parameters()))
    out: dict[str, Any] = {"dtype": args.dtype, "threads": torch.get_num_threads(), "tokens": args.tokens}
    short = max(2, args.tokens // 4)
    for batch in (int(b) for b in args.batches.split(",")):
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for family, (engine, _) in engines.items():  # interleaved: noise hits every family alike
                rate = batch * (args.tokens - short) / (run(engine, batch, args.tokens) - run(engine, batch, short))
                best[family] = max(best.get(family, 0.0), rate)
        llama_per_byte = best["llama"] * engines["llama"][1]
        for family, rate in best.items():
            out[f"{family}_b{batch}"] = {"tokens_per_s": round(rate, 1), "weight_bytes": engines[family][1],
                                         "per_byte_vs_llama": round(rate * engines[family][1] / llama_per_byte, 3)}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
