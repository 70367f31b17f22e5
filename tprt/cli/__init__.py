"""The command-line glue: the only part of tprt that imports `convert` and `serve`.

`main` parses (`tprt.cli.main`); `generate` runs `tprt generate` / `tprt score`, `finetune` runs
`tprt finetune` / `tprt merge-lora`, `demo` runs `tprt demo`. `python -m tprt.cli` is `tprt`.
"""

from tprt.cli.main import main

__all__ = ["main"]
