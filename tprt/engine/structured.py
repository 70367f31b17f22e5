"""The engine's side of output constraints (rank 0): each constrained row's matcher, its
next-token masks for a step, and the throttle on rows whose masks cost too much.

`tprt.engine.constraints` compiles specs and matches tokens; `StructuredOutputManager` here
puts them to work in the engine's step:

- `compile` / `matcher`: a request's constraint, compiled once per content (thread-safe: a front
  end compiles, and so checks, a request on its own thread; the engine then finds it cached);
- `start(rows)`: the masks of a step's constrained rows, one per position they choose (a
  verifying row's next token, then one after each drafted token). With `mask_threads` > 0 they
  are filled on that many threads while the forward pass runs (llguidance releases the GIL);
  with 0 (no core to spare: the CPU kernels use them all, and a thread beside them would stall
  them at every barrier) each is computed after the pass, and only where it changes the choice:
  a greedy row whose most likely token the grammar takes needs none;
- `throttle(running, forward_s)`: rows whose masks cost more than their share of a step sit
  steps out (`Sequence.held`), so costly grammars slow themselves, not the batch.

How many threads are spare is the launcher's to say (tprt.cpu.threads.spare_cores), not sniffed here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tprt.engine.constraints import ConstraintSpec, Matcher, StructuredOutputs, bits_to_bool
from tprt.engine.sequence import Sequence
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer

MIN_MASK_SHARE_S = 0.002  # what constrained rows' masks may add to a step in all, at least (`throttle`)
MAX_MASK_THREADS = 8  # constrained rows' masks computed at once after the pass, at most


class RowMasks:
    """One constrained row's next-token bitmasks for a step: position j is the token after the
    row's first j drafted tokens (all of which its grammar accepts: drafts are cut to it). Filled
    ahead (`fill`) on a mask thread, or computed when asked (`needed`), walking the matcher along
    the draft and back. A position whose grammar allows nothing may only end: EOS."""

    def __init__(self, seq: Sequence, draft: list[int], outputs: StructuredOutputs, eos: list[int]) -> None:
        assert seq.matcher is not None
        self._matcher: Matcher = seq.matcher
        self._draft = draft
        self._outputs = outputs
        self._eos = eos
        self.positions = 1 + len(draft)
        self._ahead: torch.Tensor | None = None  # [positions, words], when filled ahead

    def fill(self) -> None:
        """Computes every position's mask now, before the step's tokens are chosen."""
        words = self._outputs.bitmask(self.positions)
        self._walk(lambda j: self._fill(words[j]))
        self._ahead = words

    def needed(self, best: list[int], greedy: bool, known: int) -> list[torch.Tensor | None]:
        """Each position's int32 bitmask row, or None where it would not change the choice: a
        greedy row (`greedy`: argmax, no penalty) whose most likely token `best[j]` the grammar
        takes there."""
        out: list[torch.Tensor | None] = [None] * self.positions
        ahead = self._ahead

        def visit(j: int) -> None:
            if greedy and best[j] < known and self._allows(j, best[j]):
                return
            if ahead is not None:
                out[j] = ahead[j]
            else:
                out[j] = row = self._outputs.bitmask(1)[0]
                self._fill(row)

        if ahead is None:
            self._walk(visit)  # the matcher must stand at each position
        else:
            for j in range(self.positions):
                visit(j)
        return out

    def _walk(self, visit: Callable[[int], None]) -> None:
        """Calls visit(j) with the matcher at each position in turn (the draft accepted up to
        it), then rolls the matcher back to where it was."""
        consumed = 0
        for j in range(self.positions):
            visit(j)
            if j == len(self._draft) or not self._matcher.accept(self._draft[j]):
                break  # (a refused draft cannot happen: it was cut to the grammar)
            consumed += 1
        self._matcher.rollback(consumed)

    def _fill(self, row: torch.Tensor) -> None:
        self._matcher.fill_bitmask(row)
        if self._eos and not row.any():
            row[self._eos[0] // 32] = _signed_bit(self._eos[0] % 32)

    def _allows(self, position: int, token: int) -> bool:
        """Whether the grammar takes `token` at `position` (the matcher standing there): from the
        mask when filled ahead, else by asking about that one token (microseconds, not a mask)."""
        if self._ahead is not None:
            return bool(int(self._ahead[position, token // 32]) >> (token % 32) & 1)
        return self._matcher.validates([token]) == 1


class StructuredOutputManager:
    """Rank 0's output constraints in the engine's step (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Seq[int],
                 mask_threads: int = 0) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._outputs: StructuredOutputs | None = None
        self._lock = threading.Lock()
        self.mask_threads = mask_threads
        self._pool: ThreadPoolExecutor | None = None  # beside the forward pass
        self._after: ThreadPoolExecutor | None = None  # after it, when the cores are free

    @property
    def outputs(self) -> StructuredOutputs:
        """The compiler for this engine's tokenizer (built at first use; thread-safe)."""
        with self._lock:
            if self._outputs is None:
                if self._tokenizer is None:
                    raise ValidationError("constraint", "output constraints need the model's tokenizer, "
                                                        "which it does not have")
                self._outputs = StructuredOutputs(self._tokenizer)
            return self._outputs

    @outputs.setter
    def outputs(self, outputs: StructuredOutputs) -> None:
        """Uses `outputs` (e.g. one whose compile and mask times feed a server's metrics)."""
        with self._lock:
            self._outputs = outputs

    def matcher(self, spec: ConstraintSpec) -> Matcher:
        """A new sequence's matcher for `spec` (compiled, or found in the cache)."""
        outputs = self.outputs
        return outputs.matcher(outputs.compile(spec))

    @staticmethod
    def grammar_prefix(seq: Sequence, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` that seq's constraint accepts (all of it without one)."""
        if seq.matcher is None or not draft:
            return draft
        n = seq.matcher.accept_prefix(draft)
        seq.matcher.rollback(n)
        return draft[:n]

    @property
    def _known(self) -> int:
        """Tokens the tokenizer (and so the matcher) knows."""
        return min(self._vocab, self.outputs.vocab_size)

    def start(self, rows: list[tuple[Sequence, list[int]]]) -> Future[dict[str, RowMasks]]:
        """Each (sequence, draft) row's masks for the step: filled on `mask_threads` threads
        while the forward pass runs, or (with none) left to `needed`, after it."""
        eos = [t for t in self._eos_token_ids if t < self._known][:1]
        masks = {seq.request_id: RowMasks(seq, draft, self.outputs, eos) for seq, draft in rows}
        if self.mask_threads > 0:
            if self._pool is None:  # one thread hands out the rows, the others fill them
                self._pool = ThreadPoolExecutor(1 + self.mask_threads, thread_name_prefix="tprt-masks")
            return self._pool.submit(self._fill, masks)
        done: Future[dict[str, RowMasks]] = Future()
        done.set_result(masks)
        return done

    def _fill(self, masks: dict[str, RowMasks]) -> dict[str, RowMasks]:
        rows = list(masks.values())
        chunks = [rows[i :: self.mask_threads] for i in range(min(self.mask_threads, len(rows)))]
        if len(chunks) <= 1:
            for row in rows:
                row.fill()
            return masks
        assert self._pool is not None
        for done in [self._pool.submit(_fill_all, chunk) for chunk in chunks[1:]]:
            done.result()
        _fill_all(chunks[0])
        return masks

    def allowed(self, rows: list[tuple[RowMasks | None, list[int], bool]]) -> torch.Tensor | None:
        """[positions, vocab] bool (on the CPU) for `sample`, or None when no position needs one.
        `rows`: each choosing row's masks (None: unconstrained), its most likely token at each
        position, and whether its choice is a plain argmax (greedy, no penalty)."""
        known = self._known if any(m is not None for m, _, _ in rows) else self._vocab

        def masks_of(row: tuple[RowMasks | None, list[int], bool]) -> list[torch.Tensor | None]:
            masks, best, greedy = row
            return masks.needed(best, greedy, known) if masks is not None else [None] * len(best)

        constrained = sum(m is not None for m, _, _ in rows)
        if constrained > 1:  # several rows' masks at once (llguidance releases the GIL)
            if self._after is None:
                threads = min(MAX_MASK_THREADS, os.cpu_count() or 1)
                self._after = ThreadPoolExecutor(threads, thread_name_prefix="tprt-mask-rows")
            per_row = list(self._after.map(masks_of, rows))
        else:
            per_row = [masks_of(row) for row in rows]
        words = [w for row in per_row for w in row]
        needed = [(i, w) for i, w in enumerate(words) if w is not None]
        if not needed:
            return None
        mask = torch.ones(len(words), self._vocab, dtype=torch.bool)
        bools = bits_to_bool(torch.stack([w for _, w in needed]), known)
        for k, (i, _) in enumerate(needed):
            mask[i, :known] = bools[k]
            mask[i, known:] = False
        return mask

    def throttle(self, running: list[Sequence], forward_s: float) -> None:
        """Constrained rows whose masks cost more than their share of a step sit steps out
        (`Sequence.held`): together the masks may add about one forward pass (`forward_s`, at
        least MIN_MASK_SHARE_S) to a step. Each row earns its share every step and decodes when
        its savings cover what its last mask took; a row whose masks stay under its share is
        never held, and some row decodes every step."""
        rows = [(s, s.matcher.last_mask_s) for s in running if s.matcher is not None]  # only these are held
        if not rows:
            return
        share = max(MIN_MASK_SHARE_S, forward_s) / len(rows)
        for seq, cost in rows:
            seq.mask_credit = min(seq.mask_credit + share, max(cost, share))
            seq.held = cost > seq.mask_credit
            if not seq.held:
                seq.mask_credit -= cost
        if len(rows) == len(running) and all(s.held for s, _ in rows):
            first, _ = max(rows, key=lambda r: r[0].mask_credit / max(r[1], 1e-9))  # the closest to its turn
            first.held = False
            first.mask_credit = 0.0


def _fill_all(rows: list[RowMasks]) -> None:
    for row in rows:
        row.fill()


def _signed_bit(bit: int) -> int:
    """The int32 value with only `bit` set (bit 31 is the sign)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)
