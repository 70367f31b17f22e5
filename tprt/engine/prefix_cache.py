"""The KV block pool on rank 0: which blocks each sequence holds, and prefix sharing between them.

The paged KV cache (tprt.model.kv_cache) is a pool of blocks of `block_size` positions; this is
its bookkeeping, kept by rank 0 only (the other ranks get each row's block table in the plan).
A sequence takes blocks as it grows (`grow`) and gives them back when it ends or is preempted
(`release`). Block 0 is the cache's scratch block and is never handed out.

Prefix sharing at block granularity: once every position of a block is computed, the block is
named by a digest chained over its tokens, its parent block's digest and the cache key the
sequence's keys and values were computed with (the adapter: its keys and values differ, and the
engine changes the key when an adapter's weights change). A new sequence whose prompt begins with
named blocks under the same key points its table at them instead of computing them (`match`):
64 streams sharing a system prompt hold it once. Blocks carry reference counts; a named block
nobody references stays cached (its keys and values intact) until the pool needs room, then the
least recently released goes first. A referenced block is never evicted, and a full block is
never written again, so sharing needs no copies.

With `events` set to a list, the pool records what a router that follows prefixes needs to know
(serve/kv_events.py publishes it): each block named (`BlockNamed`: its digest, its parent's, its
tokens and cache key) and each named block evicted (`BlockEvicted`). A named block that is only
cached stays named; it is evicted when its room is taken.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tprt.model.kv_cache import SCRATCH_BLOCK

Digest = bytes


def chain_digest(parent: Digest, key: Hashable, tokens: Sequence[int]) -> Digest:
    """The name of a full block: its tokens, its parent's name and the cache key. (A cryptographic
    digest, so equal names mean equal contents; `repr(key)` keeps the key opaque here.)"""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(repr(key).encode())
    h.update(b"\0")
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


ROOT: Digest = b""  # the parent of a sequence's first block


@dataclass(frozen=True)
class BlockNamed:
    digest: Digest
    parent: Digest  # ROOT for a sequence's first block
    tokens: tuple[int, ...]
    key: Hashable  # the cache key (the adapter's index and load generation)


@dataclass(frozen=True)
class BlockEvicted:
    digest: Digest


KVEvent = BlockNamed | BlockEvicted


class BlockPool:
    """Free, referenced and cached blocks of one KV cache (see the module docstring)."""

    def __init__(self, n_blocks: int, block_size: int, share: bool = True) -> None:
        if n_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is scratch), got {n_blocks}")
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.share = share  # name full blocks and match prefixes (prefix caching)
        self._free = list(range(n_blocks - 1, SCRATCH_BLOCK, -1))  # a stack: low ids first
        self._refs = [0] * n_blocks
        self._by_digest: dict[Digest, int] = {}
        self._digest_of: dict[int, Digest] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # named, unreferenced: least recent first
        self.events: list[KVEvent] | None = None  # a list: named and evicted blocks are recorded there

    @property
    def capacity(self) -> int:
        """Blocks that can hold a sequence's keys and values (all but scratch)."""
        return self.n_blocks - 1

    @property
    def available(self) -> int:
        """Blocks a sequence can take now: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.capacity - self.available

    @property
    def cached(self) -> int:
        return len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def match(self, tokens: Sequence[int], key: Hashable, limit: int) -> tuple[list[int], list[Digest]]:
        """The named blocks holding the longest block-aligned prefix of `tokens` (at most `limit`
        tokens) computed under `key`, each now referenced once more, and their digests."""
        blocks: list[int] = []
        digests: list[Digest] = []
        if not self.share:
            return blocks, digests
        parent, size = ROOT, self.block_size
        for start in range(0, limit - size + 1, size):
            digest = chain_digest(parent, key, tokens[start : start + size])
            block = self._by_digest.get(digest)
            if block is None:
                break
            self._take(block)
            blocks.append(block)
            digests.append(digest)
            parent = digest
        return blocks, digests

    def grow(self, blocks: list[int], tokens: int) -> bool:
        """Appends blocks to `blocks` until they hold `tokens` positions; False (and nothing
        taken) when the pool has too few."""
        need = -(-tokens // self.block_size) - len(blocks)
        if need > self.available:
            return False
        for _ in range(need):
            if not self._free:  # evict the least recently released cached block
                victim, _ = self._cached.popitem(last=False)
                digest = self._digest_of.pop(victim)
                del self._by_digest[digest]
                self._free.append(victim)
                if self.events is not None:
                    self.events.append(BlockEvicted(digest))
            block = self._free.pop()
            self._refs[block] = 1
            blocks.append(block)
        return True

    def name(self, blocks: list[int], digests: list[Digest], tokens: Sequence[int], key: Hashable) -> None:
        """Names the blocks that `tokens` (a sequence's computed tokens) fill completely and are
        not yet named, extending `digests`; a block whose contents another block already holds
        stays unnamed (freed, not cached, at release)."""
        if not self.share:
            return
        size = self.block_size
        for i in range(len(digests), len(tokens) // size):
            parent = digests[-1] if digests else ROOT
            digest = chain_digest(parent, key, tokens[i * size : (i + 1) * size])
            digests.append(digest)
            if digest not in self._by_digest and blocks[i] not in self._digest_of:
                self._by_digest[digest] = blocks[i]
                self._digest_of[blocks[i]] = digest
                if self.events is not None:
                    self.events.append(BlockNamed(digest, parent, tuple(tokens[i * size : (i + 1) * size]), key))

    def release(self, blocks: list[int]) -> None:
        """Drops one reference to each block; an unreferenced named block is cached (most
        recently released last, the sequence's last block first to go), any other is freed. The
        scratch block (a table's placeholder for blocks given back early) is no one's."""
        for block in reversed(blocks):
            if block == SCRATCH_BLOCK:
                continue
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise ValueError(f"block {block} released more often than taken")
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        blocks.clear()

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached.pop(block)
        self._refs[block] += 1
