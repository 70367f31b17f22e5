"""tprt.engine.prefix_cache: the bookkeeping behind prefix reuse (the engine's use of it is checked against
transformers in tests/test_engine.py: check_prefix_reuse and the mixed-adapter test)."""

from __future__ import annotations

import random

from tprt.engine.prefix_cache import PrefixCache, common_prefix


def test_common_prefix_matches_a_plain_loop() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        limit = rng.randrange(0, 50)
        want = 0
        while want < min(len(a), len(b), limit) and a[want] == b[want]:
            want += 1
        assert common_prefix(a, b, limit) == want, (a, b, limit)


def test_match_takes_the_longest_prefix_under_the_same_key_and_leaves_the_last_token() -> None:
    cache = PrefixCache(4)
    base, lora = cache.key(0), cache.key(1)
    cache.keep(0, [1, 2, 3], base)
    cache.keep(1, [1, 2, 3, 4, 5, 6], lora)
    cache.keep(2, [1, 2, 9], base)
    assert cache.match([1, 2, 3, 4, 5], base) == (0, 3)
    assert cache.match([1, 2, 3, 4, 5], lora) == (1, 4), "the prompt's last token must be computed"
    assert cache.match([1, 2, 3], base) == (0, 2)
    assert cache.match([7, 2, 3], base) == (None, 0)
    # a live sequence's computed tokens count too, and win when longer
    assert cache.match([1, 2, 3, 4, 5], base, [(3, [1, 2, 3, 4], base)]) == (3, 4)
    assert cache.match([1, 2, 3, 4, 5], base, [(3, [1, 2, 3, 4], lora)]) == (0, 3)


def test_invalidate_forgets_one_adapter_and_changes_its_key() -> None:
    cache = PrefixCache(2)
    old = cache.key(1)
    cache.keep(0, [1, 2, 3], old)
    cache.keep(1, [1, 2, 3], cache.key(0))
    cache.invalidate(1)
    assert cache.key(1) != old
    assert cache.match([1, 2, 3, 4], cache.key(1)) == (None, 0)
    assert cache.match([1, 2, 3, 4], old, [(0, [1, 2, 3], old)]) == (0, 3), "live rows carry their own key"
    assert cache.match([1, 2, 3, 4], cache.key(0)) == (1, 3), "other adapters' records stay"
    assert cache.match([1, 2, 3, 4], old) == (None, 0), "the old version's record is dropped"


def test_slot_for_prefers_the_source_then_empty_then_least_recently_kept() -> None:
    cache = PrefixCache(4)
    key = cache.key(0)
    for slot in (2, 0, 1):  # kept in this order: slot 2 is the oldest record
        cache.keep(slot, [slot + 1], key)
    assert cache.slot_for([0, 1, 2, 3], source=1) == 1, "the source slot itself: no copy"
    assert cache.slot_for([0, 1, 2, 3], source=None) == 3, "an empty slot before any record"
    assert cache.slot_for([0, 1, 2], source=None) == 2, "then the least recently kept record"
    assert cache.slot_for([0, 2], source=3) == 2, "a live source: a free slot, the oldest record"
    cache.drop(2)
    assert cache.slot_for([0, 1, 2], source=None) == 2


def test_relocate_saves_a_record_from_packing_unless_every_free_slot_holds_a_newer_one() -> None:
    cache = PrefixCache(4)
    key = cache.key(0)
    cache.keep(3, [9], key)  # older
    cache.keep(0, [1, 2, 3], key)  # slot 0 is about to receive a live sequence
    assert cache.relocate(0, [2, 3]) == (2, 3), "an empty free slot first"
    assert cache.match([1, 2, 3, 4], key) == (2, 3) and cache.relocate(0, [3]) is None
    cache.keep(1, [5, 6], key)  # newest
    assert cache.relocate(1, [3]) == (3, 2), "evicts the older record"
    assert cache.match([9, 9], key) == (None, 0)
    cache.keep(0, [7, 7], key)
    cache.keep(3, [8], key)  # newer than slot 0's
    assert cache.relocate(0, [3]) is None, "every free slot holds a newer record"
    assert cache.match([7, 7, 7], key) == (0, 2), "the hole's record is left in place (then overwritten)"
