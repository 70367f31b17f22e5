"""Generation: each step rank 0's scheduler writes one batch of tokens (`scheduler`), every rank
runs it (`runner`), rank 0 chooses the tokens and reports (`outputs`); `core.Engine` wires the
three. Sequences, sampling, constraints, speculation, stopping, prefix reuse and static decode
live beside them.

`tprt.engine.Engine` is the public entry point (README, "The engine").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tprt.engine.core import Completion, Engine, EngineConfig, run_to_completion
    from tprt.engine.sequence import TokenEvent

__all__ = ["Completion", "Engine", "EngineConfig", "TokenEvent", "run_to_completion"]


def __getattr__(name: str) -> Any:
    """The public names, loaded on first use: torch-free modules of the package (spec_defaults)
    stay importable without torch."""
    if name == "TokenEvent":
        from tprt.engine.sequence import TokenEvent

        return TokenEvent
    if name in __all__:
        from tprt.engine import core

        return getattr(core, name)
    raise AttributeError(f"module 'tprt.engine' has no attribute {name!r}")
