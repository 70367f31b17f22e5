"""`tprt calibrate-kv`: static int8 KV cache scales measured on text (tprt.model.kv_scales).

The text is read, tokenized and checked in the starting process; the model runs on the
checkpoint's TP number of ranks like `tprt score` (tprt.distributed.launcher.run_on_ranks), each
rank measuring its own kv heads; rank 0 writes the file (atomically).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from tprt.checkpoint.format import TPCheckpoint
from tprt.checkpoint.loading import load_model, parse_dtype
from tprt.cli.generate import read_documents
from tprt.distributed.context import init_distributed
from tprt.distributed.launcher import run_on_ranks
from tprt.errors import ConfigError
from tprt.model.kv_scales import DEFAULT_MARGIN, calibrate, check_margin, save_kv_scales, scales_from_amax
from tprt.text.tokenizer import Tokenizer

EPILOG = f"""examples:
  tprt calibrate-kv --model ./smollm2-tp3 --file chats.jsonl --out kv_scales.safetensors
  tprt serve --model ./smollm2-tp3 --kv-cache-dtype int8 --kv-scales kv_scales.safetensors

An int8 KV cache keeps a scale per token and kv head by default (1.94x the tokens of bf16 at
head_dim 64, 1.97x at 128). With static scales, one per layer, k/v and kv head measured here, it
stores nothing per token: exactly 2x. Each head's scale is --margin (default {DEFAULT_MARGIN}) times the
largest |key| or |value| the text puts in it, over 127; larger values met later are clipped, so
calibrate on text like what you will serve (a few thousand tokens are enough), and check the
result: tprt score --kv-cache-dtype int8 --kv-scales FILE on other text, against --kv-cache-dtype
int8 alone. A .jsonl file holds one {{"text": ...}} object per line; any other file is one
document. A document longer than the model's context is cut into pieces of that length.
"""


@dataclass(frozen=True)
class CalibrateArgs:
    model: Path
    files: tuple[Path, ...]
    out: Path
    margin: float = DEFAULT_MARGIN
    dtype: str | None = None
    threads: int | None = None


@dataclass(frozen=True)
class CalibrateJob:
    model: str
    dtype: str | None
    documents: list[list[int]]
    out: str
    margin: float


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = sub.add_parser("calibrate-kv", help="measure static int8 KV cache scales on text (2x bf16's tokens)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run text through a TP checkpoint and write the static int8 KV cache scales "
                                   "that `--kv-cache-dtype int8 --kv-scales FILE` serves with.")
    c.add_argument("--model", type=Path, required=True, metavar="DIR", help="TP checkpoint directory")
    c.add_argument("--file", dest="files", type=Path, action="append", required=True, metavar="TEXT_OR_JSONL",
                   help="calibration text: .txt (one document) or .jsonl (several allowed)")
    c.add_argument("--out", type=Path, required=True, metavar="FILE", help="the scales file to write (.safetensors)")
    c.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help=f"scale = margin x the largest value seen / 127 (default {DEFAULT_MARGIN}; at least 1)")
    c.add_argument("--dtype", metavar="{fp32,bf16,fp16}", help="compute dtype (default: the checkpoint's)")
    c.add_argument("--threads", type=int, metavar="N", help="torch threads per rank (default: cores / TP)")


def run(args: argparse.Namespace) -> int:
    return run_calibrate(CalibrateArgs(model=args.model, files=tuple(args.files), out=args.out, margin=args.margin,
                                       dtype=args.dtype, threads=args.threads))


def prepare_calibrate(args: CalibrateArgs) -> CalibrateJob:
    """Reads, tokenizes and checks everything; a ConfigError/CheckpointError of one line."""
    ckpt = TPCheckpoint(args.model)
    if args.dtype is not None:
        parse_dtype(args.dtype)
    check_margin(args.margin)
    if not args.out.parent.is_dir():
        raise ConfigError(f"--out {args.out}: its directory {args.out.parent} does not exist")
    if args.out.is_dir():
        raise ConfigError(f"--out {args.out}: is a directory; name the file to write")
    tok = Tokenizer.from_dir(args.model)
    context = ckpt.config.max_position_embeddings
    docs: list[list[int]] = []
    for path in args.files:
        for text in read_documents(path):
            ids = tok.encode(text)
            docs.extend(ids[a : a + context] for a in range(0, len(ids), context))
    if not docs:
        raise ConfigError(f"--file {', '.join(map(str, args.files))}: no text to calibrate on")
    return CalibrateJob(str(args.model), args.dtype, docs, str(args.out), args.margin)


def run_calibrate(args: CalibrateArgs) -> int:
    job = prepare_calibrate(args)
    run_on_ranks(job.model, calibrate_rank, (job,), threads=args.threads, tp1_in_process=True)
    return 0


def calibrate_rank(job: CalibrateJob) -> None:
    """One rank's part: every rank runs every document (collective); rank 0 writes the file."""
    from tqdm import tqdm

    ctx = init_distributed()
    model = load_model(job.model, ctx, job.dtype)
    tokens = sum(len(d) for d in job.documents)
    with tqdm(total=tokens, desc="calibrate-kv", unit="tok", file=sys.stderr, dynamic_ncols=True,
              disable=ctx.rank != 0 or not sys.stderr.isatty()) as bar:
        amax = calibrate(model, job.documents, progress=bar.update)
    if ctx.rank != 0:
        return
    save_kv_scales(Path(job.out), scales_from_amax(amax, job.margin), job.margin, tokens)
    cfg = model.config
    print(f"calibrated on {tokens} tokens ({len(job.documents)} sequence(s)): static scales for "
          f"{cfg.num_hidden_layers} layers x k/v x {cfg.num_key_value_heads} kv heads, margin {job.margin}, "
          f"written to {job.out}\nserve with: --kv-cache-dtype int8 --kv-scales {job.out}", flush=True)
