"""Generation: rank 0's scheduler plans each step (`scheduler`, writing a `plan`), the driver
(`core.Engine`) runs it on every rank (`runner`), samples and reports; sequences, sampling,
stopping, prefix reuse and static decode live beside them.

`tprt.engine.Engine` is the public entry point (README, "The engine").
"""

from tprt.engine.core import Completion, Engine, EngineConfig, run_to_completion
from tprt.engine.sequence import TokenEvent

__all__ = ["Completion", "Engine", "EngineConfig", "TokenEvent", "run_to_completion"]
