"""tprt.engine.prefix_cache.BlockPool: block allocation, prefix sharing by chained block digests,
reference counts and LRU eviction (the engine's use of it is checked against transformers in
tests/test_engine.py)."""

from __future__ import annotations

import pytest

from tprt.engine.prefix_cache import BlockPool

SYSTEM = list(range(100, 164))  # a 64-token shared prefix: 4 blocks of 16


def _sequence(pool: BlockPool, tokens: list[int], key: object = (0, 0)) -> tuple[list[int], list[bytes], int]:
    """Admits a sequence as the engine does: shared blocks for its prefix, new ones for the rest,
    all of it computed and its full blocks named. Returns (blocks, digests, shared tokens)."""
    blocks, digests = pool.match(tokens, key, len(tokens) - 1)
    shared = len(blocks) * pool.block_size
    assert pool.grow(blocks, len(tokens))
    pool.name(blocks, digests, tokens, key)
    return blocks, digests, shared


def test_common_prefix_is_held_once() -> None:
    """N sequences sharing a 64-token prefix hold its 4 blocks once, each referenced N times."""
    pool = BlockPool(n_blocks=200, block_size=16)
    seqs = [_sequence(pool, SYSTEM + [i] * 20) for i in range(8)]
    prefix = seqs[0][0][:4]
    assert all(blocks[:4] == prefix for blocks, _, _ in seqs)
    assert [shared for _, _, shared in seqs] == [0] + [64] * 7
    assert all(pool.refs(b) == 8 for b in prefix)
    assert pool.used == 4 + 8 * 2  # the prefix once, then 20 tokens (2 blocks) per sequence


def test_the_cache_key_separates_adapters() -> None:
    pool = BlockPool(n_blocks=50, block_size=16)
    base, _, _ = _sequence(pool, SYSTEM + [1])
    adapted, _, shared = _sequence(pool, SYSTEM + [1], key=(3, 0))
    assert shared == 0 and not set(base) & set(adapted)
    again, _, shared = _sequence(pool, SYSTEM + [2], key=(3, 0))
    assert shared == 64 and again[:4] == adapted[:4]


def test_referenced_blocks_are_never_evicted_and_eviction_is_lru() -> None:
    """Released named blocks stay cached and are shared by a later match; when the pool needs
    room it evicts unreferenced blocks, least recently released first (a sequence's last block
    before its first), never one a live sequence holds; an exhausted pool refuses."""
    pool = BlockPool(n_blocks=9, block_size=4)  # 8 usable blocks
    a, _, _ = _sequence(pool, list(range(8)))  # 2 full blocks, named
    b, _, _ = _sequence(pool, list(range(50, 58)))
    pool.release(a)
    pool.release(b)
    assert (pool.used, pool.cached, pool.available) == (0, 4, 8)
    live, _, shared = _sequence(pool, list(range(9)))  # a's two blocks, from the cache, and a new one
    assert shared == 8 and pool.cached == 2 and pool.refs(live[0]) == 1
    held: list[int] = []
    assert pool.grow(held, 3 * 4) and pool.cached == 2  # the last 3 free blocks: nothing evicted
    more: list[int] = []
    assert pool.grow(more, 4) and pool.cached == 1  # evicts b's last block (released before its first)
    first, _ = pool.match(list(range(50, 58)), (0, 0), 7)
    assert len(first) == 1 and pool.available == 0  # b's first block survived, and is now referenced
    assert not pool.grow(more, 8), "the pool handed out a block it does not have"
    assert len({*live, *held, *more, *first}) == 8 and all(pool.refs(x) == 1 for x in live + held + more + first)


def test_release_checks_references() -> None:
    pool = BlockPool(n_blocks=3, block_size=2)
    blocks: list[int] = []
    assert pool.grow(blocks, 3) and blocks == [1, 2] and pool.available == 0
    again = list(blocks)
    pool.release(blocks)
    with pytest.raises(ValueError, match="released more often"):
        pool.release(again)


def test_without_sharing_nothing_is_named() -> None:
    pool = BlockPool(n_blocks=20, block_size=4, share=False)
    first, _, _ = _sequence(pool, SYSTEM[:12])
    pool.release(first)
    _, _, shared = _sequence(pool, SYSTEM[:12])
    assert shared == 0 and pool.cached == 0
