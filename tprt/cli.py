"""The `tprt` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tprt.errors import TprtError

EPILOG = """examples:
  tprt demo                              convert the bundled SmolLM2 model and show the result
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tprt",
        description="Tensor-parallel runtime for Llama models. Checkpoints come from `tprt-convert`.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the pipeline on the real SmolLM2-135M-Instruct model")
    demo.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory (default: demo-out)")
    demo.add_argument("--tp", type=int, default=3, help="TP degree of the demo checkpoint (default: 3)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from tprt.demo import DemoArgs, run_demo

            return run_demo(DemoArgs(out=args.out, tp=args.tp))
    except TprtError as e:
        print(f"tprt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tprt: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
