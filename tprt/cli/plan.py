"""`tprt plan`: per-rank memory of serving or fine-tuning a model at a TP degree, before running it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tprt.cli.common_flags import Spelling
from tprt.engine.graph_buckets import GRAPH_MODES
from tprt.model.config import SUPPORTED_ARCHITECTURES
from tprt.errors import ConfigError

PLAN_EPILOG = """examples:
  tprt plan --model bench/configs/llama-3.1-70b --tp 8 --device h100-80gb serve --max-seq-len 8192
  tprt plan --model bench/configs/llama-3.1-70b --tp 8 --device h100-80gb serve --quantize fp8
  tprt plan --model bench/configs/llama-3.1-70b --tp 8 --device h100-80gb finetune --lora-rank 16 --seq-len 4096 --batch-size 1
  tprt plan --model bench/configs/llama-3.1-70b --tp 8 --device h100-80gb finetune --full --dtype bf16
  tprt plan --model ./smollm2-tp3 --tp 3 --device cpu finetune --objective dpo --batch-size 2 --seq-len 256
  tprt plan --model ./smollm2-tp3 --tp 3 --device cpu --json serve --max-batch-size 8
  tprt plan --model meta-llama/Llama-3.3-70B-Instruct --tp 8 --device h100-80gb serve

--model is an HF model directory, a config.json, a TP checkpoint or a Hub repo id (only its
config.json is fetched, through huggingface_hub and its cache). Every number is bytes on one
rank, computed from the model's parameter shapes at that TP degree (vocabulary padding, kv-head
replication, tied embeddings, LoRA factors) and from how tprt allocates on that device (CPU:
packed weight copies, a float32 KV cache for bf16 models). See docs/SCALE.md.

Architectures: {archs} (config.json's `architectures`).
"""

def _common(p: argparse.ArgumentParser, suppress: bool) -> None:
    """The model/layout/device flags, accepted before or after the workload (after: no defaults,
    so that they do not overwrite what came before)."""
    d: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    p.add_argument("--model", type=Path, metavar="SRC",
                   help="HF model directory, config.json, TP checkpoint or Hub repo id (org/name)", **d)
    p.add_argument("--revision", metavar="R", help="for a Hub repo: branch, tag or commit (default: main)", **d)
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel degree", **d)
    p.add_argument("--dp", type=int, metavar="M", help="data-parallel replicas (default 1)", **d)
    p.add_argument("--pp", type=int, metavar="P",
                   help="pipeline stages, each TP ranks holding its share of the layers (default 1); the plan "
                        "is the fullest stage's, every stage's peak listed", **d)
    p.add_argument("--device", metavar="{h100-80gb,h200-141gb,a100-80gb,a100-40gb,cpu}", help="one rank's device", **d)
    p.add_argument("--device-memory", type=float, metavar="GIB", help="override the device's memory (GiB)", **d)
    p.add_argument("--json", action="store_true", help="print one JSON object", **d)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="per-rank memory of serving or fine-tuning at a TP degree", epilog=PLAN_EPILOG.format(archs=", ".join(SUPPORTED_ARCHITECTURES)),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Plan a model's memory per rank: weights, KV cache, activations, gradients, "
                                   "optimizer state; whether it fits, and what would.")
    _common(p, suppress=False)
    work = p.add_subparsers(dest="workload", required=True, metavar="{serve,finetune}", parser_class=type(p))
    s = work.add_parser("serve", help="the engine of `tprt serve`")
    _common(s, suppress=True)
    s.add_argument("--dtype", metavar="{fp32,bf16,fp16}", help="weights and compute (default: the checkpoint's)")
    s.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", action=Spelling,
                   metavar="{fp32,bf16,fp16,int8,fp8,int8-static}",
                   help="KV cache, as tprt serve's flag (default: the model's; fp32 for bf16/fp16 on CPU, as the "
                        "engine); int8/fp8 also state the KV tokens gained against bf16; int8-static: int8 with the "
                        "static scales of tprt calibrate-kv (serve's --kv-scales)")
    s.add_argument("--quantize", "--weight-dtype", dest="weight_dtype", action=Spelling, choices=("int8", "fp8"),
                   help="the decoder's linear weights quantized, as tprt-convert's flag; states the KV tokens freed")
    s.add_argument("--weight-group-size", type=int, metavar="G",
                   help="int8: one scale per G input columns (default: per output channel)")
    s.add_argument("--max-seq-len", type=int, metavar="N", help="tokens per sequence (default: min(model's, 2048))")
    s.add_argument("--max-batch-size", type=int, default=16, metavar="N", help="running sequences at once (16)")
    s.add_argument("--kv-cache-tokens", type=int, metavar="N",
                   help="KV cache positions per rank (default: max batch size x max seq len)")
    s.add_argument("--kv-block-size", type=int, default=16, metavar="N", help="positions per KV cache block (16)")
    s.add_argument("--cuda-graphs", default="auto", choices=GRAPH_MODES,
                   help="CUDA: the graphs the engine captures (tprt serve --cuda-graphs; auto = all)")
    s.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding: drafted tokens per row (0 = off; 4 with --draft-model)")
    s.add_argument("--draft-model", type=Path, metavar="SRC", help="a draft model (rank 0 holds it), as --model")
    f = work.add_parser("finetune", help="a step of `tprt finetune`")
    _common(f, suppress=True)
    m = f.add_mutually_exclusive_group()
    m.add_argument("--full", action="store_true", help="train every weight")
    m.add_argument("--lora-rank", type=int, default=8, metavar="R", help="LoRA rank (8)")
    f.add_argument("--lora-targets", default="q,k,v,o", metavar="LIST", help="comma-separated LoRA targets (q,k,v,o)")
    f.add_argument("--dtype", choices=("fp32", "bf16"), help="weights and compute (default: fp32 on CPU, bf16 on GPU)")
    f.add_argument("--batch-size", type=int, default=4, metavar="B",
                   help="rows (--objective dpo: pairs, two rows each) per micro-batch per DP rank (4)")
    f.add_argument("--objective", "--method", dest="objective", action=Spelling, choices=("sft", "dpo"), default="sft",
                   help="dpo: preference pairs, the preferred and non-preferred completion in one micro-batch (sft)")
    f.add_argument("--seq-len", type=int, default=512, metavar="L", help="tokens per row (512)")
    f.add_argument("--grad-accum", type=int, default=1, metavar="K", help="micro-batches per step (1)")
    f.add_argument("--activation-checkpointing", action="store_true", help="recompute activations in the backward")
    f.add_argument("--sequence-parallel", action="store_true",
                   help="split the norms' and block inputs' positions over the TP ranks (Megatron's)")
    f.add_argument("--offload-optimizer", choices=("none", "cpu"), default="none",
                   help="--full: fp32 shards, gradients and AdamW state in host memory (none)")


def run(args: argparse.Namespace) -> int:
    from tprt.plan.devices import device
    from tprt.plan.memory import FinetuneWorkload, ServeWorkload, Workload, plan_memory
    from tprt.plan.report import as_json, text
    from tprt.plan.source import read_source

    for flag in ("model", "tp", "device"):
        if getattr(args, flag, None) is None:
            raise ConfigError(f"tprt plan needs --{flag}")
    src = read_source(args.model, getattr(args, "revision", None))
    dp = args.dp if args.dp is not None else 1
    pp = getattr(args, "pp", None) or 1
    dev = device(args.device, args.device_memory, ranks_per_host=args.tp * dp)
    workload: Workload
    if args.workload == "serve":
        draft = read_source(args.draft_model).config if args.draft_model is not None else None
        if draft is not None and draft.vocab_size != src.config.vocab_size:
            raise ConfigError(f"--draft-model {args.draft_model}: vocab_size {draft.vocab_size} differs from the "
                              f"model's {src.config.vocab_size}")
        k = args.num_speculative_tokens or (4 if draft is not None else 0)
        if k < 0:
            raise ConfigError(f"--num-speculative-tokens must be at least 0, got {k}")
        workload = ServeWorkload(dtype=args.dtype or src.dtype, kv_dtype=args.kv_dtype, max_seq_len=args.max_seq_len,
                                 max_batch_size=args.max_batch_size, kv_cache_tokens=args.kv_cache_tokens,
                                 kv_block_size=args.kv_block_size, weight_dtype=args.weight_dtype,
                                 weight_group_size=args.weight_group_size, num_speculative_tokens=k, draft=draft,
                                 cuda_graphs=args.cuda_graphs)
    else:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        workload = FinetuneWorkload(full=args.full, lora_rank=args.lora_rank, lora_targets=targets,
                                    dtype=args.dtype or ("fp32" if dev.kind == "cpu" else "bf16"),
                                    batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
                                    activation_checkpointing=args.activation_checkpointing,
                                    sequence_parallel=args.sequence_parallel,
                                    sharded=args.full, offload_optimizer=args.offload_optimizer == "cpu",
                                    dpo=args.objective == "dpo")
    plan = plan_memory(src.config, args.tp, workload, dev, dp, src.vocab_align, pp)
    print(json.dumps(as_json(plan), indent=2) if args.json else text(plan))
    return 0
