"""Generation: rank 0 plans each step (`core.Engine`, `plan`), every rank executes it
(`runner`); sequences, sampling, stopping, prefix reuse and static decode live beside them.

`tprt.engine.Engine` is the public entry point (README, "The engine").
"""

from tprt.engine.core import Completion, Engine, EngineConfig, run_to_completion
from tprt.engine.sequence import TokenEvent

__all__ = ["Completion", "Engine", "EngineConfig", "TokenEvent", "run_to_completion"]
