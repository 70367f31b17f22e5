"""Stop conditions for one generated sequence: EOS, stop ids, stop strings and the length limit.

Like OpenAI and vLLM, a stop string and everything after it are left out of the output text, and the
text of the token that stopped generation (EOS or a stop id) is not emitted. Streamed text never
contains the beginning of a stop string that might still complete: such a tail is held back until it
either cannot be a stop string any more or generation ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from tprt.errors import ValidationError
from tprt.engine.sampling import SamplingParams

FinishReason = Literal["stop", "length"]


class StopStringMatcher:
    """Finds the first stop string in streamed text, holding back tails that could start one."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValidationError("stop_strings", "stop_strings must be non-empty strings")
        self._stops = tuple(stop_strings)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None  # the stop string found, once found

    def feed(self, delta: str) -> str:
        """Returns the text that is safe to emit; after a match, the text before it (then "")."""
        if self.matched is not None:
            return ""
        text = self._held + delta
        hit = self._first_match(text)
        if hit is not None:
            start, self.matched = hit
            self._held = ""
            return text[:start]
        keep = self._unsafe_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail, for when generation ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = text.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _unsafe_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0


class Detokenizer(Protocol):
    """What StopChecker needs from tprt.text.tokenizer.IncrementalDetokenizer."""

    def add(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


@dataclass(frozen=True)
class StepOutput:
    """What one generated token adds to a sequence's output."""

    text: str  # text to stream now (may be "")
    finish_reason: FinishReason | None = None  # None while the sequence goes on
    stop_reason: int | str | None = None  # the stop id or stop string; None for EOS and length


class StopChecker:
    """Per-sequence stop logic: feed each generated id, stream `text`, stop when `finish_reason` is set.

    The stopping id itself counts towards max_new_tokens and is part of the generated ids, but its
    text is not emitted. Without a detokenizer only ids are checked (stop_strings then refused)."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int],
                 detokenizer: Detokenizer | None = None) -> None:
        if params.stop_strings and detokenizer is None:
            raise ValueError("StopChecker: stop_strings need a detokenizer")
        self._params = params
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._detok = detokenizer
        self._matcher = StopStringMatcher(params.stop_strings)
        self.num_generated = 0
        self.finish_reason: FinishReason | None = None

    def step(self, token_id: int) -> StepOutput:
        if self.finish_reason is not None:
            raise RuntimeError("StopChecker.step after the sequence finished")
        self.num_generated += 1
        if token_id in self._eos or token_id in self._stop_ids:
            reason: int | None = token_id if token_id in self._stop_ids and token_id not in self._eos else None
            return self._finish("stop", self._detok.flush() if self._detok else "", reason)
        delta = self._detok.add(token_id) if self._detok else ""
        if self.num_generated >= self._params.max_new_tokens:
            return self._finish("length", delta + (self._detok.flush() if self._detok else ""), None)
        text = self._matcher.feed(delta)
        if self._matcher.matched is not None:
            self.finish_reason = "stop"
            return StepOutput(text, "stop", self._matcher.matched)
        return StepOutput(text)

    def finish(self, reason: FinishReason = "length") -> StepOutput:
        """Ends the sequence for a reason outside the checker (e.g. the context is full)."""
        return self._finish(reason, self._detok.flush() if self._detok else "", None)

    def _finish(self, reason: FinishReason, pending: str, stop_id: int | None) -> StepOutput:
        text = self._matcher.feed(pending)
        if self._matcher.matched is not None:  # the last text completed a stop string
            self.finish_reason = "stop"
            return StepOutput(text, "stop", self._matcher.matched)
        self.finish_reason = reason
        return StepOutput(text + self._matcher.flush(), reason, stop_id)
