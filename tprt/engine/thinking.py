"""A reasoning model's thinking, as the engine steers it (serve/core/reasoning.py splits the text).

Qwen3 and the DeepSeek-R1 distills think inside `<think>` ... `</think>` before they answer. Two
request options need the engine to know where a sequence is in that block:

- a thinking budget: after that many thinking tokens the closing ids are forced, one per step,
  whatever the model would have chosen (its answer then starts);
- an output constraint that applies to the answer only: the sequence's matcher is parked while
  it thinks and takes over after the closing ids (tprt.engine.sequence.Sequence.append).

When the reply must open the block itself (Qwen3's templates leave it to the model), its opening
ids are forced first, so the budget counts from a known start. Forced tokens replace the sampled
choice at the first position of the sequence's row (tprt.engine.outputs); a draft after it is
then rejected as any wrong draft is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tprt.errors import ValidationError


@dataclass(frozen=True)
class Thinking:
    """How one request thinks: `open_ids` (forced first; empty when the prompt opened the block),
    `close_ids` (the block's end), `budget` (thinking tokens at most before the close is forced;
    None: no limit)."""

    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    budget: int | None = None

    def validate(self, vocab_size: int) -> Thinking:
        if not self.close_ids or any(not 0 <= t < vocab_size for t in self.open_ids + self.close_ids):
            raise ValidationError("thinking", "thinking: the block's ids must be in the vocabulary")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 0):
            raise ValidationError("thinking_budget", f"thinking_budget: expected an integer >= 0, got {self.budget!r}")
        return self


class ThinkingState:
    """One sequence's place in its thinking: the ids it must emit next, the tokens thought."""

    def __init__(self, spec: Thinking) -> None:
        self.spec = spec
        self.forced = list(spec.open_ids)  # emitted next, one per step
        self.closing = spec.budget == 0  # the forced ids end the block
        if self.closing:
            self.forced += spec.close_ids
        self.thought = 0
        self.done = False
        self._tail: list[int] = []  # the last thinking ids, to see the model close the block itself

    def observe(self, token_id: int) -> bool:
        """Records an emitted token (the forced one while `forced` is not empty); True when the
        block has just closed."""
        if self.done:
            return False
        if self.forced:
            self.forced.pop(0)
            self.done = self.closing and not self.forced
            return self.done
        close = list(self.spec.close_ids)
        self._tail = (self._tail + [token_id])[-len(close):]
        if self._tail == close:
            self.done = True
            return True
        self.thought += 1
        if self.spec.budget is not None and self.thought >= self.spec.budget:
            self.forced, self.closing = close, True
        return False
