"""Flags that several commands share, defined once so that one thing has one name everywhere
(`tprt generate`, `tprt serve`, `tprt plan`, `tprt-convert`); light, so that building a parser
imports no torch. A renamed flag keeps its old spelling as an alias that says so when used."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

KV_CACHE_DTYPE_HELP = ("KV cache storage: auto (the model dtype; float32 for bf16 on CPU), bf16, fp32, int8 or fp8 "
                       "(e4m3); int8/fp8 keep a scale per head and token and hold about 2x the tokens of bf16")


class Spelling(argparse.Action):
    """Stores a flag's value under any of its spellings; an old one (any but the first) also
    says, on stderr, which spelling to use."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string is not None and option_string != self.option_strings[0]:
            print(f"{parser.prog}: {option_string} is the old spelling of {self.option_strings[0]}; it still works",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_kv_cache_flags(group: Any, default: str | None = "auto", help_dtype: str = KV_CACHE_DTYPE_HELP) -> None:
    """--kv-cache-dtype and --kv-scales (tprt generate, tprt serve, tprt score)."""
    group.add_argument("--kv-cache-dtype", default=default, metavar="{auto,bf16,fp32,int8,fp8}", help=help_dtype)
    group.add_argument("--kv-scales", type=Path, metavar="FILE",
                       help="static int8 KV scales from `tprt calibrate-kv` (implies --kv-cache-dtype int8): nothing "
                            "stored per token, exactly 2x the tokens of bf16")

