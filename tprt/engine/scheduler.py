"""The engine's scheduler: which sequences run in the next step, with which tokens and KV blocks.

Plain data in, a plan out: no process group, no tensors, no model. It keeps the queue of waiting
sequences, the admitted ones and the KV block pool (tprt.engine.prefix_cache.BlockPool), and
each `schedule()` writes one `tprt.model.batch.TokenBatch`: decode rows first (each running
sequence's last token and its draft), then prompt chunks, all in one flat batch of tokens. The
driver (tprt.engine.core.Engine) runs it on the ranks, samples, and reports back what was
computed (`prefilled`, `decoded`).

Admission: waiting sequences join in arrival order while the per-step token budget, `max_batch`
admitted sequences (checked here only) and free blocks last; a prompt longer than what is left
of the budget is prefilled in chunks over several steps.

Rows carry k tokens: a decoding sequence's row is its last sampled token followed by its `draft`
(tokens proposed for the positions after it, e.g. by a speculative drafter or a forced run), so
one row writes and returns logits for 1 + len(draft) positions. What the driver does not keep is
given back (`decoded(seq, kept)`, `truncate`): blocks past the kept positions return to the pool.
A block is named for prefix sharing only once every position in it is kept, so a shared or cached
block never holds a position that may still be given back.

Preemption: when the pool runs out, the most recently admitted sequences give their blocks back
and wait at the head of the queue to be recomputed (prompt and output so far), so the oldest
always progress and admitted work always finishes.

Priority: a sequence's `priority` (0: interactive, the default; higher: background, e.g. a
batch's requests) orders the queue, the token budget and preemption. Waiting sequences are
admitted lower priority value first (arrival order within a priority); admitted ones get their
blocks and prefill budget in that order; the pool's victims are the most recently admitted of the
lowest priority; a waiting sequence that finds no room (max_batch taken, or too few free
blocks for its first chunk) preempts running sequences of a lower priority (higher value) to
make it; and while an interactive prompt is prefilled, background sequences sit those steps out
(keeping their blocks), so its first token costs what it would cost alone. Background work thus
fills what interactive traffic leaves; what it still costs an interactive request is the
decode rows it adds to the steps after the first token.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from tprt.model.batch import BatchRow, TokenBatch
from tprt.engine.prefix_cache import BlockPool
from tprt.model.kv_cache import SCRATCH_BLOCK


class Status(enum.Enum):
    WAITING = "waiting"  # added (or preempted), holds no KV blocks
    PREFILLING = "prefilling"  # admitted: part of its tokens are in the cache
    RUNNING = "running"  # prompt done, decoding a row of 1 + len(draft) tokens per step
    FINISHED = "finished"


class Scheduled(Protocol):
    """What the scheduler reads and keeps of a sequence (tprt.engine.sequence.Sequence is one)."""

    request_id: str
    status: Status
    adapter: int  # adapter index its rows are routed to; 0: the base model
    blocks: list[int]  # its KV block table
    digests: list[bytes]  # the names of its full, kept blocks, in order
    num_computed: int  # leading tokens whose keys and values are in its blocks (and kept)
    prefill_target: int  # tokens to prefill before decoding: the prompt, or all so far after preemption
    cached_prompt_tokens: int
    output: list[int]
    draft: list[int]  # tokens proposed after its last one, verified in its next decode row
    held: bool  # sits out the coming decode step (the engine's throttle on costly output constraints)
    in_flight: bool  # in a step whose tokens are not chosen yet: sits out, never a victim
    priority: int  # 0: interactive; higher: background (see the module docstring)

    @property
    def cache_key(self) -> Hashable: ...  # what its keys and values are computed with (prefix sharing)

    @property
    def length(self) -> int: ...

    @property
    def needs_logits(self) -> bool: ...

    def tokens(self, n: int) -> list[int]: ...


S = TypeVar("S", bound=Scheduled)


def _priority(seq: Scheduled) -> int:
    return seq.priority


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int  # sequences admitted at once (prefilling or decoding)
    token_budget: int  # tokens per step: every decode row's tokens plus prefill chunks
    n_blocks: int  # KV blocks in the pool, scratch included
    block_size: int  # positions per block
    prefix_cache: bool = True  # name full blocks and share common prefixes
    # Every layer attends through this sliding window (Mistral): a sequence's blocks wholly before
    # its next position's window go back to the pool (its table holds the scratch block there).
    window: int | None = None


@dataclass(frozen=True)
class KVStats:
    """The KV block pool and the prefix cache, for metrics: blocks now, and counts since start."""

    block_size: int
    blocks_used: int  # held by live sequences (a shared block once)
    blocks_cached: int  # held by no one, kept for prefix reuse (evicted when the pool needs room)
    blocks_total: int
    prefix_queried_tokens: int  # tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int  # of those, found in shared blocks
    preemptions: int  # sequences preempted (blocks freed, recomputed later)


@dataclass
class Schedule(Generic[S]):
    """One step: the batch every rank runs (None: nothing to run), and the sequences behind its
    rows, in row order: `decode` first, then `prefill`."""

    batch: TokenBatch | None
    decode: list[S] = field(default_factory=list)  # row i: the sequence's last token and its draft
    prefill: list[tuple[S, int]] = field(default_factory=list)  # (sequence, chunk length)

    def ends_prompt(self, seq: S, n: int) -> bool:
        """Whether a chunk of n tokens finishes seq's prefill (its last token's logits choose the next)."""
        return seq.num_computed + n == seq.prefill_target


class Scheduler(Generic[S]):
    """Admission, token budget, KV blocks, preemption and prefix sharing (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.n_blocks, config.block_size, share=config.prefix_cache)
        self.waiting: deque[S] = deque()
        self.running: list[S] = []  # admitted (prefilling or decoding), in admission order
        self.preemptions = 0  # sequences preempted (blocks freed, recomputed later)
        self.prefix_queried_tokens = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0  # of those, found in shared blocks

    # ------------------------------------------------------------------ sequences in and out

    def add(self, seq: S) -> None:
        """Queues a sequence (WAITING, holding no blocks) behind the others of its priority."""
        seq.status = Status.WAITING
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: S, front: bool) -> None:
        """Into the waiting queue: after every sequence of a lower priority value, and before
        (`front`, a preempted one) or after the others of its own."""
        at = len(self.waiting)
        while at > 0 and (self.waiting[at - 1].priority > seq.priority
                          or front and self.waiting[at - 1].priority == seq.priority):
            at -= 1
        self.waiting.insert(at, seq)

    def remove(self, seq: S) -> None:
        """Ends a sequence (finished or cancelled) wherever it is; its blocks go back to the pool."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.pool.release(seq.blocks)
        if seq in self.running:
            self.running.remove(seq)
        seq.status = Status.FINISHED

    # ------------------------------------------------------------------ planning

    def schedule(self) -> Schedule[S]:
        """The next step's batch and the sequences behind its rows.

        Admitted sequences, oldest first, each get the blocks for this step's tokens: a row of
        1 + len(draft) tokens per decoding sequence (drafts trimmed to what the budget leaves
        after one token per decoding sequence), then prefill chunks from what is left of the
        token budget. When the pool runs dry, the most recently admitted sequences are preempted,
        so the oldest always progress. Then waiting sequences are admitted in order while the
        budget, `max_batch` and free blocks last (admission never preempts). Nothing is padded:
        the budget counts the batch's tokens. Priorities order all of it (see the module
        docstring)."""
        self._make_room()
        decode_rows: list[S] = []
        extras: dict[str, int] = {}
        prefill_rows: list[tuple[S, int]] = []
        urgent = self._interactive_prefill()  # background rows sit this step out

        def sits_out(seq: S) -> bool:
            return seq.held or seq.in_flight or (urgent and seq.priority > 0)

        decoding = [s for s in self.running if s.status is Status.RUNNING and not sits_out(s)]
        spare = self.config.token_budget - len(decoding)  # for draft tokens, oldest rows first
        for seq in decoding:
            extras[seq.request_id] = extra = min(len(seq.draft), max(spare, 0))
            spare -= extra
        budget = self.config.token_budget - len(decoding) - sum(extras.values())
        # Interactive first. A victim of the pool is the most recently admitted of the lowest
        # priority: never a sequence this loop has already given a row.
        for seq in sorted(self.running, key=_priority):
            if seq.status is Status.WAITING:  # preempted by one before it in this loop
                continue
            if sits_out(seq):
                pass  # keeps its blocks and its place; runs in a later step
            elif seq.status is Status.RUNNING:
                # The row's tokens go at positions length - 1 .. length - 1 + extra.
                if self._grow(seq, seq.length + extras[seq.request_id]):
                    decode_rows.append(seq)
            elif budget > 0:
                room = (len(seq.blocks) + self.pool.available) * self.pool.block_size - seq.num_computed
                n = min(seq.prefill_target - seq.num_computed, budget, max(room, 1))
                if self._grow(seq, seq.num_computed + n):
                    prefill_rows.append((seq, n))
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch:
            if urgent and self.waiting[0].priority > 0:
                break
            n = self._admit(self.waiting[0], budget)
            if not n:
                break
            prefill_rows.append((self.running[-1], n))
            budget -= n
        schedule: Schedule[S] = Schedule(None, decode_rows, prefill_rows)
        rows = [BatchRow(tuple(s.blocks), s.length - 1, (s.output[-1], *s.draft[: extras[s.request_id]]),
                         1 + extras[s.request_id], s.adapter) for s in decode_rows]
        ends = [schedule.ends_prompt(s, n) for s, n in prefill_rows]
        rows += [BatchRow(tuple(s.blocks), s.num_computed, tuple(s.tokens(s.num_computed + n)[s.num_computed :]),
                          int(end), s.adapter) for (s, n), end in zip(prefill_rows, ends)]
        if rows:
            full = (any(s.needs_logits for s in decode_rows)
                    or any(s.needs_logits for (s, _), end in zip(prefill_rows, ends) if end))
            schedule.batch = TokenBatch.of(rows, full)
        return schedule

    # ------------------------------------------------------------------ after the step

    def prefilled(self, seq: S, n: int) -> bool:
        """n more of seq's prompt tokens are in its blocks; True when its prefill is done (it then
        decodes from the next step on)."""
        seq.num_computed += n
        self._name(seq)
        self._free_behind_window(seq)
        if seq.num_computed == seq.prefill_target:
            seq.status = Status.RUNNING
            return True
        return False

    def decoded(self, seq: S, kept: int) -> None:
        """After a decode row: the row's first `kept` tokens (its input token, then accepted draft
        tokens) stay in the cache; the positions after them are given back."""
        self.truncate(seq, seq.num_computed + kept)
        self._free_behind_window(seq)
        seq.draft = []

    def truncate(self, seq: S, n: int) -> None:
        """seq keeps the keys and values of its first n positions: the blocks past them go back
        to the pool and the blocks they fill get their names. n may not reach into a named block
        (those positions were kept, and another sequence may share them)."""
        named = len(seq.digests) * self.pool.block_size
        if not named <= n <= len(seq.blocks) * self.pool.block_size:
            raise ValueError(f"truncate {seq.request_id!r} to {n} positions: must be in [{named} (named blocks), "
                             f"{len(seq.blocks) * self.pool.block_size} (its blocks)]")
        seq.num_computed = n
        keep = -(-n // self.pool.block_size)
        tail = seq.blocks[keep:]
        del seq.blocks[keep:]
        self.pool.release(tail)
        self._name(seq)

    # ------------------------------------------------------------------ stats

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_stats(self) -> KVStats:
        p = self.pool
        return KVStats(p.block_size, p.used, p.cached, p.capacity, self.prefix_queried_tokens,
                       self.prefix_hit_tokens, self.preemptions)

    # ------------------------------------------------------------------ internals

    def _name(self, seq: S) -> None:
        """Names the blocks seq's kept positions fill completely (prefix sharing)."""
        if seq.num_computed // self.pool.block_size > len(seq.digests):
            self.pool.name(seq.blocks, seq.digests, seq.tokens(seq.num_computed), seq.cache_key)

    def _free_behind_window(self, seq: S) -> None:
        """With a sliding window on every layer: the blocks every later query of seq no longer sees
        (wholly before the window of its next position, num_computed) go back to the pool, named
        ones to the prefix cache; the table keeps the scratch block in their place, which the
        attention kernels skip or mask."""
        window = self.config.window
        if window is None:
            return
        behind = min(max(seq.num_computed - window + 1, 0) // self.pool.block_size, len(seq.blocks))
        for i in range(behind):
            if seq.blocks[i] != SCRATCH_BLOCK:
                self.pool.release([seq.blocks[i]])
                seq.blocks[i] = SCRATCH_BLOCK

    def _interactive_prefill(self) -> bool:
        """Whether this step prefills an interactive sequence beside background ones: then the
        background rows sit the step out, so a prompt's first token costs what it costs alone."""
        if not any(s.priority > 0 for s in self.running):
            return False
        return bool(self.waiting and self.waiting[0].priority == 0) or any(
            s.priority == 0 and s.status is Status.PREFILLING for s in self.running)

    def _victim(self) -> S | None:
        """The admitted sequence to preempt first: the most recently admitted of the lowest
        priority (highest value), of those not in a step in flight; None when every one is."""
        free = [s for s in self.running if not s.in_flight]
        if not free:
            return None
        worst = max(s.priority for s in free)
        return next(s for s in reversed(free) if s.priority == worst)

    def _make_room(self) -> None:
        """Preempts background sequences for a waiting one of a higher priority that would not
        otherwise be admitted: max_batch is taken, or the pool lacks the blocks of its first chunk."""
        while self.waiting and self.running:
            head, victim = self.waiting[0], self._victim()
            if victim is None or victim.priority <= head.priority:
                return
            chunk = min(head.prefill_target, self.config.token_budget)
            need = -(-chunk // self.pool.block_size) + 1
            if len(self.running) < self.config.max_batch and self.pool.available >= need:
                return
            self._preempt(victim)

    def _grow(self, seq: S, tokens: int) -> bool:
        """Gives an admitted sequence the blocks for `tokens` positions, preempting the most
        recently admitted sequences of the lowest priority while the pool is short; False when seq
        itself was the one preempted (it then waits at the head of its priority in the queue), or
        when it would be the victim while steps are in flight (their blocks come back soon: it
        sits this step out instead)."""
        while not self.pool.grow(seq.blocks, tokens):
            victim = self._victim()
            if victim is None or (victim is seq and any(s.in_flight for s in self.running)):
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: S) -> None:
        """Frees an admitted sequence's blocks and queues it first, to be recomputed: its prompt
        and output so far are prefilled again (its full blocks stay cached for that, until
        evicted) and decoding continues where it stopped."""
        self.pool.release(seq.blocks)
        seq.digests.clear()
        seq.draft = []  # the recomputing prefill chooses the token at its first position itself
        seq.num_computed = 0
        seq.prefill_target = seq.length
        seq.status = Status.WAITING
        self.running.remove(seq)
        self._enqueue(seq, front=True)
        self.preemptions += 1

    def _admit(self, seq: S, budget: int) -> int:
        """Admits the waiting `seq` with its first chunk of at most `budget` tokens (after the
        longest prefix of named blocks it can reuse); returns the chunk's length, 0 when the pool
        cannot hold even one more token now."""
        tokens = seq.tokens(seq.prefill_target)
        # The last token is always computed, for its logits.
        blocks, digests = self.pool.match(tokens, seq.cache_key, seq.prefill_target - 1)
        start = len(blocks) * self.pool.block_size
        room = (len(blocks) + self.pool.available) * self.pool.block_size - start
        n = min(seq.prefill_target - start, budget, room)
        if n <= 0 or not self.pool.grow(blocks, start + n):
            self.pool.release(blocks)
            return 0
        self.prefix_queried_tokens += seq.prefill_target
        self.prefix_hit_tokens += start
        seq.blocks, seq.digests = blocks, digests
        seq.num_computed = start
        if not seq.output:
            seq.cached_prompt_tokens = start
        seq.status = Status.PREFILLING
        self.waiting.popleft()
        self.running.append(seq)
        return n
