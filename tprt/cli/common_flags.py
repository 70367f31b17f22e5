"""One name for one thing in every command: a renamed flag keeps its old spelling as an alias
that says so when used (`Spelling`). The flags several commands share are defined once beside
their settings (tprt.engine.settings: the KV cache's, the scheduler's; tprt.cli.speculative_flags).
Light, so that building a parser imports no torch."""

from __future__ import annotations

import argparse
import sys
from typing import Any



class Spelling(argparse.Action):
    """Stores a flag's value under any of its spellings; an old one (any but the first) also
    says, on stderr, which spelling to use."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string is not None and option_string != self.option_strings[0]:
            print(f"{parser.prog}: {option_string} is the old spelling of {self.option_strings[0]}; it still works",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)
