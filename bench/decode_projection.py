"""A projection, not a measurement: batch-1 decode tokens/s of a model at a TP degree on a GPU.

Model: each decode step every rank streams its weights once (weights_bytes_per_rank from
`tprt.plan`, at the device's streaming HBM bandwidth) plus the sequence's keys and values, and
the step waits for 2 all-reduces per layer (attention and MLP outputs, Megatron's two) of a
hidden-sized vector, each costing a fixed latency. CUDA graphs (tprt's static decode) remove the
launch overhead; compute is negligible at batch 1. tokens/s = 1 / (weights/BW + kv/BW + 2 x
layers x latency).

    .venv/bin/python bench/decode_projection.py --model bench/configs/llama-3.1-70b --tp 8 --device h100-80gb
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tprt.plan.devices import GPUS, device
from tprt.plan.memory import ServeWorkload, plan_memory
from tprt.plan.source import read_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--device", choices=sorted(GPUS), default="h100-80gb")
    ap.add_argument("--bandwidth", type=float, help="HBM streaming bandwidth in TB/s (default: the device's)")
    ap.add_argument("--context", type=int, default=1024, help="tokens of KV read per step (1024)")
    ap.add_argument("--allreduce-us", type=float, nargs="+", default=[8.0, 15.0, 25.0],
                    help="latency of one small all-reduce in microseconds (several: one row each)")
    args = ap.parse_args()
    src = read_source(args.model)
    dev = device(args.device)
    bw = args.bandwidth * 1e12 if args.bandwidth else dev.hbm_bytes_per_s
    assert bw is not None
    plan = plan_memory(src.config, args.tp, ServeWorkload(max_seq_len=args.context, max_batch_size=1), dev,
                       vocab_align=src.vocab_align)
    weights_s = plan.weights_bytes_per_rank / bw
    kv_s = plan.kv_bytes_per_token_per_rank * args.context / bw
    layers = src.config.num_hidden_layers
    print(f"PROJECTION (not measured): {args.model.name} TP={args.tp} on {dev.name}, batch 1, {args.context} tokens of context")
    print(f"  weights per rank {plan.weights_bytes_per_rank / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s: {weights_s * 1e3:.2f} ms")
    print(f"  KV read per rank {plan.kv_bytes_per_token_per_rank * args.context / 1e6:.1f} MB: {kv_s * 1e3:.3f} ms")
    for us in args.allreduce_us:
        comm_s = 2 * layers * us * 1e-6
        step = weights_s + kv_s + comm_s
        print(f"  all-reduce {us:g} us x {2 * layers}: {comm_s * 1e3:.2f} ms -> {step * 1e3:.2f} ms/token, "
              f"{1 / step:.0f} tokens/s")


if __name__ == "__main__":
    main()
