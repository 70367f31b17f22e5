"""Prefix reuse: a new prompt starts from the keys and values a KV slot already holds.

A finished sequence's slot keeps its prompt's and output's keys and values until something
overwrites it; a running sequence's slot holds them too. When a request arrives whose prompt
begins with tokens one of those slots holds (the same chat system prompt, the next turn of a
conversation, a retried request), the engine copies those positions into the new sequence's slot
(one KV move in the step plan, or none when the new sequence takes that very slot) and prefills
only the rest. The copy is ~100 KB per token for SmolLM2 against ~0.3 GFLOP of prefill per token.

This module is rank 0's bookkeeping only: which token ids each *free* slot still holds (a live
sequence's slot is described by the sequence itself), and which slot a new sequence should take.
Nothing is stored beyond the KV cache the engine already has, so the cache costs no memory; a free
slot's record is lost when the slot is reused, least recently kept first.

Keys and values depend on the adapter a row was routed to, so a record matches only requests for
the same adapter, and replacing an adapter's weights (`invalidate`) forgets its records.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# (adapter index, version of its weights): what keys and values were computed with.
CacheKey = tuple[int, int]


@dataclass(frozen=True)
class _Held:
    tokens: list[int]  # ids at positions 0..len-1 of the slot, keys and values computed
    key: CacheKey
    kept: int  # when the slot was freed (or last refreshed): least recent is reused first


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit` (binary search over slice
    comparisons, which run in C: a 2k-token prompt costs ~11 compares, not 2k Python steps)."""
    hi = min(len(a), len(b), limit)
    if hi <= 0 or a[0] != b[0]:
        return 0
    if a[:hi] == b[:hi]:
        return hi
    lo = 1  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """What each free KV slot still holds, for `match` and `slot_for` (see the module docstring)."""

    def __init__(self, n_slots: int) -> None:
        self._held: list[_Held | None] = [None] * n_slots
        self._versions: dict[int, int] = {}
        self._clock = itertools.count()

    def key(self, adapter: int) -> CacheKey:
        """The key a request routed to `adapter` computes its keys and values with, now."""
        return adapter, self._versions.get(adapter, 0)

    def keep(self, slot: int, tokens: list[int], key: CacheKey) -> None:
        """Slot is free (or was copied elsewhere) and still holds `tokens` computed under `key`."""
        self._held[slot] = _Held(tokens, key, next(self._clock)) if tokens else None

    def drop(self, slot: int) -> None:
        """Slot is about to be overwritten."""
        self._held[slot] = None

    def invalidate(self, adapter: int) -> None:
        """The adapter's weights changed: what was computed with the old ones never matches again."""
        self._versions[adapter] = self._versions.get(adapter, 0) + 1
        self._held = [h if h is None or h.key[0] != adapter else None for h in self._held]

    def match(self, prompt: list[int], key: CacheKey,
              live: Iterable[tuple[int, list[int], CacheKey]] = ()) -> tuple[int | None, int]:
        """(slot, n): the slot holding the longest prefix of `prompt` computed under `key`, among
        the free slots' records and the `live` (slot, computed tokens, key) of running sequences,
        and how many positions it covers. At most len(prompt) - 1: the prompt's last token is
        always computed, for its logits. (None, 0) when nothing matches."""
        limit = len(prompt) - 1
        best: tuple[int | None, int] = (None, 0)
        held = ((slot, h.tokens, h.key) for slot, h in enumerate(self._held) if h is not None)
        for slot, tokens, k in itertools.chain(held, live):
            if k == key:
                n = common_prefix(prompt, tokens, limit)
                if n > best[1]:
                    best = (slot, n)
        return best

    def relocate(self, slot: int, free: Sequence[int]) -> tuple[int, int] | None:
        """`slot` is about to be overwritten (a live sequence is moved into it to keep the slots
        packed): (free slot, positions) to copy its record to first, and the record follows; None
        when it holds nothing, or every free slot holds a more recent record (kept instead)."""
        held = self._held[slot]
        if held is None or not free:
            return None
        target = self.slot_for(free, None)
        target_held = self._held[target]
        if target_held is not None and target_held.kept > held.kept:
            return None
        self._held[target], self._held[slot] = held, None
        return target, len(held.tokens)

    def slot_for(self, free: Sequence[int], source: int | None) -> int:
        """Which free slot a new sequence takes: its prefix's own slot when that is free (no copy),
        else a free slot holding nothing, else the one whose record was kept longest ago."""
        if source is not None and source in free:
            return source
        empty = [s for s in free if self._held[s] is None]
        if empty:
            return empty[0]
        return min(free, key=lambda s: self._held[s].kept)  # type: ignore[union-attr]
