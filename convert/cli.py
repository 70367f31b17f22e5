"""`tprt-convert` (also `python -m convert`): argument parsing and error reporting around convert.api."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from convert import api, engine
from tprt.checkpoint.hub import is_hub_id
from tprt.errors import OutputError, TprtError

PROG = "tprt-convert"

DESCRIPTION = """\
Convert Llama checkpoints between Hugging Face, tensor-parallel (TP) and GGUF forms.

A TP checkpoint is a directory holding config.json, the tokenizer files, tprt_manifest.json
(shapes, split rules, true and padded vocabulary, sha256 of every file) and one
rank-XXXXX-of-XXXXX.safetensors per rank, each with only that rank's slice of every weight.
Conversions stream: memory use stays bounded whatever the model size. Every output is written
to a temporary directory and renamed into place only when complete; an existing DST is
refused unless --force is given. A .gguf file is accepted wherever SRC is.
"""

EPILOG = """\
examples:
  tprt-convert hf-to-tp ./Llama-3.1-8B ./llama8b-tp4 --tp 4
  tprt-convert hf-to-tp ./Llama-3.1-8B ./llama8b-tp8 --tp 8 --dtype bf16
  tprt-convert hf-to-tp ./Llama-3.1-8B ./llama8b-int8-tp2 --tp 2 --quantize int8 --group-size 128
  tprt-convert hf-to-tp meta-llama/Llama-3.1-8B-Instruct ./llama8b-tp4 --tp 4 --stream
  tprt-convert reshard ./llama8b-tp8 ./llama8b-tp2 --tp 2
  tprt-convert tp-to-hf ./llama8b-tp2 ./llama8b-hf
  tprt-convert gguf-to-hf ./SmolLM2-135M.Q4_1.gguf ./smollm2-hf
  tprt-convert gguf-to-hf org/Model-GGUF ./model-hf --gguf-file model.Q4_1.gguf
  tprt-convert verify ./llama8b-tp4
  tprt-convert verify meta-llama/Llama-3.1-8B-Instruct

exit status: 0 success, 1 failure (verify found problems, disk full, ...), 2 bad usage or input.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _quant_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=("int8", "fp8"), default=None,
                   help="store the decoder's linear weights quantized, with float32 scales per output channel "
                        "(fp8: e4m3, for GPUs); embeddings, LM head and norms stay float")
    p.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="int8: one scale per G input columns instead of per channel (e.g. 32, 128); each "
                        "rank's columns of o_proj/down_proj must be whole groups")


def _common(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    if dtype:
        p.add_argument("--dtype", metavar="{bf16,fp16,fp32}",
                       help="convert floating-point weights to this dtype (default: keep the source's)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: on when stderr is a terminal)")


def _hub_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Hub source (SRC = org/name)", "Shards download one after another while the previous "
                             "one converts; an interrupted run resumes when rerun.")
    g.add_argument("--revision", metavar="R", help="branch, tag or commit (default: main)")
    g.add_argument("--token", metavar="T", help="Hub token (default: HF_TOKEN, else the stored login)")
    g.add_argument("--stream", action="store_true",
                   help="delete each shard from the Hugging Face cache once its tensors are written, unless "
                        "it was cached before this run (disk: output + about two shards)")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    p = sub.add_parser("hf-to-tp", help="HF directory (or .gguf) -> TP checkpoint", formatter_class=fmt,
                       description="Split an HF Llama checkpoint into one safetensors file per TP rank.")
    p.add_argument("src", metavar="SRC", help="HF model directory, .gguf file or Hub repo id (org/name)")
    p.add_argument("dst", type=Path, metavar="DST", help="TP checkpoint directory to create")
    p.add_argument("--tp", type=int, required=True, metavar="N", help="number of ranks")
    p.add_argument("--vocab-align", type=int, default=64, metavar="A",
                   help="pad the vocabulary to a multiple of A*N rows (default 64)")
    _quant_flags(p)
    _hub_flags(p)
    _common(p)

    p = sub.add_parser("reshard", help="TP checkpoint -> TP checkpoint with another TP degree", formatter_class=fmt,
                       description="Re-split a TP checkpoint directly from its rank files.")
    p.add_argument("src", type=Path, metavar="SRC", help="TP checkpoint directory")
    p.add_argument("dst", type=Path, metavar="DST", help="TP checkpoint directory to create")
    p.add_argument("--tp", type=int, required=True, metavar="M", help="new number of ranks")
    p.add_argument("--vocab-align", type=int, default=None, metavar="A",
                   help="vocabulary padding multiple per rank (default: the source's)")
    _quant_flags(p)
    _common(p)

    p = sub.add_parser("tp-to-hf", help="TP checkpoint -> HF directory", formatter_class=fmt,
                       description="Reassemble a TP checkpoint into HF safetensors shards, loadable by "
                                   "transformers. The original shard layout is reproduced when known.")
    p.add_argument("src", type=Path, metavar="SRC", help="TP checkpoint directory (or .gguf file)")
    p.add_argument("dst", type=Path, metavar="DST", help="HF directory to create")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="regroup into shards of at most SIZE, e.g. 5GB or 500MB "
                        "(default: the source's layout, else 5GB)")
    _common(p)

    p = sub.add_parser("gguf-to-hf", help=".gguf file -> HF directory", formatter_class=fmt,
                       description="Dequantise a GGUF Llama model into HF safetensors.")
    p.add_argument("src", metavar="SRC.gguf", help="GGUF file, or a Hub repo id (org/name) holding one")
    p.add_argument("dst", type=Path, metavar="DST", help="HF directory to create")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE", help="shard size (default 5GB)")
    g = p.add_argument_group("Hub source (SRC = org/name)")
    g.add_argument("--gguf-file", metavar="NAME", help="which .gguf file of the repo (needed when it has several)")
    g.add_argument("--revision", metavar="R", help="branch, tag or commit (default: main)")
    g.add_argument("--token", metavar="T", help="Hub token (default: HF_TOKEN, else the stored login)")
    _common(p)

    p = sub.add_parser("verify", help="check a converted directory against its manifest", formatter_class=fmt,
                       description="Recompute every file's sha256 and check sizes, headers and shapes "
                                   "against the manifest and config.json. Exit 1 if anything is wrong.")
    p.add_argument("dir", metavar="DIR", help="TP checkpoint (or HF) directory, or a Hub repo id (org/name) "
                                              "to verify its download in the Hugging Face cache")
    p.add_argument("--revision", metavar="R", help="for a Hub repo: branch, tag or commit (default: main)")
    p.add_argument("--token", metavar="T", help="Hub token (default: HF_TOKEN, else the stored login)")
    return parser


def _to_tp(args: argparse.Namespace, progress: bool) -> int:
    if args.command == "hf-to-tp":
        m = api.hf_to_tp(args.src, args.dst, tp=args.tp, dtype=args.dtype, vocab_align=args.vocab_align,
                         force=args.force, progress=progress, revision=args.revision, token=args.token,
                         stream=args.stream, quantize=args.quantize, group_size=args.group_size)
    else:
        m = api.reshard(args.src, args.dst, tp=args.tp, dtype=args.dtype, vocab_align=args.vocab_align,
                        force=args.force, progress=progress, quantize=args.quantize, group_size=args.group_size)
    fmt = m.extra.get("weight_format")
    print(f"{args.dst}: TP={m.tp_size}, {len(m.tensors)} tensors, vocabulary {m.vocab_size} "
          f"padded to {m.padded_vocab_size}" + (f", {fmt} weights" if fmt else ""))
    return 0


def _to_hf(args: argparse.Namespace, progress: bool) -> int:
    if args.command == "tp-to-hf":
        files = api.tp_to_hf(args.src, args.dst, dtype=args.dtype, force=args.force, progress=progress,
                             max_shard_size=args.max_shard_size)
    else:
        files = api.gguf_to_hf(args.src, args.dst, dtype=args.dtype, force=args.force, progress=progress,
                               max_shard_size=args.max_shard_size, revision=args.revision, token=args.token,
                               gguf_file=args.gguf_file)
    print(f"{args.dst}: {len(files)} safetensors file(s)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    problems = api.verify(args.dir, revision=args.revision, token=args.token)
    for line in problems:
        print(line)
    print(f"{args.dir}: " + ("OK" if not problems else f"{len(problems)} problem(s)"), file=sys.stderr)
    return 1 if problems else 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "verify":
        return _verify(args)
    progress = sys.stderr.isatty() if args.progress is None else bool(args.progress)
    if args.command in ("hf-to-tp", "reshard"):
        return _to_tp(args, progress)
    return _to_hf(args, progress)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kept = _resume_note(args)
    try:
        return _run(args)
    except OutputError as e:
        return _fail(str(e) + kept(), 1)
    except TprtError as e:
        return _fail(str(e) + kept(), 2)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}" + kept(), 1)
    except KeyboardInterrupt:
        return _fail("interrupted; " + (kept().lstrip("; ") or "nothing was written"), 130)


def _resume_note(args: argparse.Namespace) -> Callable[[], str]:
    """What a failed conversion from the Hub left to resume from, if anything."""
    def note() -> str:
        if args.command != "hf-to-tp" or not is_hub_id(args.src):
            return ""
        partial = args.dst.parent / f".{args.dst.name}.{engine.RESUME_DIR}"
        return f"; the part converted is kept in {partial}: rerun the same command to resume" if partial.is_dir() else ""
    return note


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
