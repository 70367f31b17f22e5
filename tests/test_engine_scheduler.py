"""tprt.engine.scheduler.Scheduler alone: plain sequences in, token batches out, no ranks and no model.

Covered: admission in arrival order under the token budget (chunked prefill, no padding),
max_batch, KV block allocation and preemption when the pool runs out (admitted work always
finishes, every block comes back), prefix sharing (shared blocks, reference counts, cached after
the end, reused by a later prompt), decode rows of k tokens (a last token and a draft, trimmed to
the budget) and giving positions back (blocks past the kept positions freed, a block named only
once its positions are kept, no truncation into a named block), and with a sliding window on
every layer, the blocks behind each sequence's window given back as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tprt.engine.scheduler import Schedule, Scheduler, SchedulerConfig, Status


@dataclass(eq=False)
class Seq:
    """The scheduling state of a request, as plain data (what tprt.engine.sequence.Sequence holds)."""

    request_id: str
    prompt: list[int]
    max_new: int = 4
    adapter: int = 0
    status: Status = Status.WAITING
    cache_key: tuple[int, int] = (0, 0)
    blocks: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    prefill_target: int = -1
    cached_prompt_tokens: int = 0
    output: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    held: bool = False
    in_flight: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        self.prefill_target = len(self.prompt)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def needs_logits(self) -> bool:
        return False

    def tokens(self, n: int) -> list[int]:
        return (self.prompt + self.output)[:n]


def make(max_batch: int = 8, token_budget: int = 64, n_blocks: int = 64, block_size: int = 4,
         prefix_cache: bool = True, window: int | None = None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_batch, token_budget, n_blocks, block_size, prefix_cache, window))


def decode_part(step: Schedule) -> list[tuple[int, tuple[int, ...]]]:
    """The batch's decode rows (first in a batch) as (start, tokens)."""
    b = step.batch
    return [] if b is None else [(b.starts[r], b.row_tokens(r)) for r in range(len(step.decode))]


def prefill_part(step: Schedule) -> list[tuple[int, tuple[int, ...]]]:
    """The batch's prompt chunks (after its decode rows) as (start, tokens)."""
    b = step.batch
    return [] if b is None else [(b.starts[r], b.row_tokens(r)) for r in range(len(step.decode), b.num_rows)]


def finish_step(s: Scheduler, step: Schedule, next_token: int = 100) -> list[Seq]:
    """What the driver does after running a batch, with `next_token + len(output)` as every
    sampled token and no draft token kept: returns the sequences that finished (removed)."""
    ended = []
    for seq, n in step.prefill:
        if s.prefilled(seq, n):
            seq.output.append(next_token + len(seq.output))
    for seq in step.decode:
        seq.output.append(next_token + len(seq.output))
        s.decoded(seq, 1)
    for seq in [*(q for q, _ in step.prefill), *step.decode]:
        if seq.status is Status.RUNNING and len(seq.output) >= seq.max_new:  # type: ignore[attr-defined]
            s.remove(seq)
            ended.append(seq)
    return ended


def run_all(s: Scheduler, limit: int = 200) -> int:
    """Steps until every sequence ended; returns the steps taken."""
    for steps in range(1, limit):
        finish_step(s, s.schedule())
        if not s.has_work:
            return steps
    raise AssertionError("the scheduler did not finish its work")


def test_admission_in_order_under_the_token_budget() -> None:
    s = make(token_budget=10)
    a, b, c = Seq("a", list(range(1, 26))), Seq("b", [1, 2, 3]), Seq("c", [4, 5])
    for q in (a, b, c):
        s.add(q)
    first = s.schedule()
    assert not first.decode and first.batch is not None
    assert [q for q, _ in first.prefill] == [a] and prefill_part(first) == [(0, tuple(range(1, 11)))]
    assert b.status is c.status is Status.WAITING
    assert first.batch.logits == (0,)  # a chunk that does not end its prompt returns no logits
    finish_step(s, first)
    second = s.schedule()  # a's second chunk takes the whole budget
    assert [(q.request_id, n) for q, n in second.prefill] == [("a", 10)]
    assert [start for start, _ in prefill_part(second)] == [10]
    finish_step(s, second)
    third = s.schedule()  # a's last 5 tokens, b's 3 and c's 2: nothing padded, 10 tokens
    assert [(q.request_id, n) for q, n in third.prefill] == [("a", 5), ("b", 3), ("c", 2)]
    assert third.batch is not None and third.batch.num_tokens == 10 and third.batch.logits == (1, 1, 1)
    finish_step(s, third)
    fourth = s.schedule()  # all three decode (one token each, at position length - 1)
    assert fourth.decode == [a, b, c] and not fourth.prefill
    assert decode_part(fourth) == [(25, (100,)), (3, (100,)), (2, (100,))]


def test_max_batch_admits_no_more_until_one_ends() -> None:
    s = make(max_batch=2)
    seqs = [Seq(str(i), [i + 1, i + 2]) for i in range(3)]
    for q in seqs:
        s.add(q)
    step = s.schedule()
    assert [q for q, _ in step.prefill] == seqs[:2] and seqs[2].status is Status.WAITING
    finish_step(s, step)
    assert [q for q, _ in s.schedule().prefill] == []  # still two admitted
    s.remove(seqs[0])
    step = s.schedule()
    assert [q for q, _ in step.prefill] == [seqs[2]] and step.decode == [seqs[1]]


def test_preemption_when_the_pool_runs_out_and_everything_finishes() -> None:
    # 4 usable blocks of 2 positions: two sequences of 3 prompt tokens and 4 new ones cannot both
    # hold their 6 positions at once, so the later one is preempted and recomputed after.
    s = make(n_blocks=5, block_size=2)
    a, b = Seq("a", [1, 2, 3]), Seq("b", [4, 5, 6])
    s.add(a)
    s.add(b)
    steps = run_all(s)
    assert s.preemptions >= 1
    assert a.output == b.output == [100, 101, 102, 103]
    assert (s.pool.used, s.pool.available) == (0, 4)  # every block back (some cached for reuse)
    assert steps > 4


def test_preempted_sequence_resumes_with_its_output_prefilled() -> None:
    s = make(n_blocks=5, block_size=2, prefix_cache=False)
    a, b = Seq("a", [1, 2, 3, 4], max_new=4), Seq("b", [5, 6, 7, 8], max_new=2)
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule())  # both prefilled: 2 blocks each, the pool is full
    assert s.pool.available == 0 and len(b.output) == 1
    b.draft = [9]  # dropped with its blocks: the recomputing prefill chooses that position's token
    step = s.schedule()  # a needs a 3rd block for position 4: b, the most recent, gives its blocks back
    assert step.decode == [a] and s.preemptions == 1 and len(a.blocks) == 3
    # b is readmitted at once with what is left (one block): its prompt and its one output token
    # are prefilled again, in chunks as blocks allow.
    assert b.prefill_target == 5 and b.num_computed == 0 and len(b.blocks) == 1 and b.output == [100]
    assert b.draft == []
    finish_step(s, step)
    run_all(s)
    assert b.output == [100, 101] and a.output == [100 + i for i in range(4)]
    assert s.pool.used == 0


def test_a_sequence_in_a_step_in_flight_sits_out_and_is_never_preempted() -> None:
    """Pipeline stages keep steps in flight (tprt.engine.core): their rows get no row in later
    steps and are no victims; one that needs a block while every other is in flight sits out."""
    s = make(n_blocks=5, block_size=2, prefix_cache=False)
    a, b = Seq("a", [1, 2, 3, 4], max_new=4), Seq("b", [5, 6, 7, 8], max_new=2)
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule())  # both prefilled: 2 blocks each, the pool is full
    b.in_flight = True
    step = s.schedule()  # a needs a 3rd block, but b (its victim before) is in flight
    assert step.batch is None and s.preemptions == 0 and len(b.blocks) == 2 and len(a.blocks) == 2
    a.in_flight, b.in_flight = True, False
    step = s.schedule()  # b needs one too, and would be its own victim: it sits out
    assert step.batch is None and s.preemptions == 0
    a.in_flight = False
    step = s.schedule()  # nothing in flight: b, the most recent, gives its blocks back as before
    assert step.decode == [a] and s.preemptions == 1
    finish_step(s, step)
    run_all(s)
    assert a.output == [100 + i for i in range(4)] and b.output == [100, 101]


def test_prefix_sharing_refcounts_and_cache_after_the_end() -> None:
    s = make(block_size=2)
    a = Seq("a", [1, 2, 3, 4, 5])
    s.add(a)
    finish_step(s, s.schedule())
    assert len(a.digests) == 2  # its two full blocks are named
    b = Seq("b", [1, 2, 3, 4, 9, 9])
    s.add(b)
    step = s.schedule()
    assert [(q, n) for q, n in step.prefill] == [(b, 2)]  # only the unshared tail is prefilled
    assert [start for start, _ in prefill_part(step)] == [4]
    assert b.blocks[:2] == a.blocks[:2] and b.cached_prompt_tokens == 4
    assert [s.pool.refs(blk) for blk in a.blocks[:2]] == [2, 2]
    assert s.prefix_hit_tokens == 4 and s.prefix_queried_tokens == 5 + 6
    finish_step(s, step)
    shared = a.blocks[:2]
    s.remove(a)
    s.remove(b)
    assert s.pool.used == 0 and s.pool.cached >= 2  # named blocks stay cached for reuse
    c = Seq("c", [1, 2, 3, 4, 7])
    s.add(c)
    s.schedule()
    assert c.blocks[:2] == shared and c.cached_prompt_tokens == 4
    # Another adapter's keys and values differ: nothing shared under another cache key.
    d = Seq("d", [1, 2, 3, 4, 7], cache_key=(1, 0))
    s.add(d)
    s.schedule()
    assert d.cached_prompt_tokens == 0 and not set(d.blocks) & set(shared)


def test_rows_of_k_tokens_and_the_budget() -> None:
    s = make(token_budget=6, block_size=2)
    a, b = Seq("a", [1, 2, 3], max_new=20), Seq("b", [4, 5, 6], max_new=20)
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule())
    a.draft, b.draft = [7, 8, 9], [10, 11, 12]
    step = s.schedule()  # 2 tokens for the rows themselves, 4 left: a's whole draft, one of b's
    assert decode_part(step) == [(3, (100, 7, 8, 9)), (3, (100, 10))]
    assert len(a.blocks) * 2 >= 3 + 4 and len(b.blocks) * 2 >= 3 + 2  # blocks for every position written


def test_giving_positions_back() -> None:
    s = make(block_size=2)
    a = Seq("a", [1, 2, 3], max_new=20)
    s.add(a)
    finish_step(s, s.schedule())  # 3 prompt positions in 2 blocks, one token sampled
    assert (a.num_computed, len(a.blocks), len(a.digests)) == (3, 2, 1)
    a.draft = [7, 8, 9, 10]
    step = s.schedule()  # positions 3..7: block 1 fills, blocks 2 and 3 hold draft tokens only
    assert decode_part(step) == [(3, (100, 7, 8, 9, 10))]
    assert len(a.blocks) == 4
    used = s.pool.used
    a.output += [7, 50]  # the driver kept the input token and one drafted token, then chose 50
    s.decoded(a, 2)
    # Positions 0..4 kept: block 1 (positions 2, 3) is full of kept tokens and gets its name;
    # block 2 holds kept position 4 (and a given-back one), block 3 only given-back ones: freed.
    assert (a.num_computed, len(a.blocks), len(a.digests), a.draft) == (5, 3, 2, [])
    assert s.pool.used == used - 1
    nxt = s.schedule()  # the next row starts at the first position given back
    assert decode_part(nxt) == [(5, (50,))]
    with pytest.raises(ValueError, match="named blocks"):
        s.truncate(a, 3)  # into block 1, named (and shareable): refused
    s.truncate(a, 4)
    assert (a.num_computed, len(a.blocks)) == (4, 2)


def test_a_block_of_draft_positions_is_not_named_until_kept() -> None:
    s = make(block_size=2)
    a = Seq("a", [1, 2], max_new=20)
    s.add(a)
    finish_step(s, s.schedule())  # block 0 full and named
    a.draft = [7, 8]
    s.schedule()  # positions 2, 3, 4: block 1 is full of this row's tokens, block 2 holds one
    a.output += [9]  # the first drafted token was not the one chosen
    s.decoded(a, 1)
    assert (a.num_computed, len(a.blocks), len(a.digests)) == (3, 2, 1)  # block 1 holds position 3, given back
    b = Seq("b", [1, 2, 100, 7, 8])
    s.add(b)
    s.schedule()
    assert b.cached_prompt_tokens == 2  # only block 0 is shared: block 1 was never named


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_blocks_behind_a_sliding_window_go_back(prefix_cache: bool) -> None:
    """Window 5, blocks of 2: after each step a sequence keeps the blocks of its next position's
    window (positions num_computed - 4 on) and gives back those wholly before it, in prompt
    chunks and in decoding; its table holds the scratch block there; a sequence of 30 positions
    never holds more than 4 blocks; preemption and the end free the rest, nothing twice."""
    from tprt.model.kv_cache import SCRATCH_BLOCK

    s = make(token_budget=4, block_size=2, window=5, prefix_cache=prefix_cache)
    a, b = Seq("a", list(range(1, 11)), max_new=20), Seq("b", list(range(1, 11)), max_new=3)
    s.add(a)
    most = 0
    while a.status is not Status.FINISHED:
        step = s.schedule()
        finish_step(s, step)
        behind = max(a.num_computed - 4, 0) // 2
        if a.status is not Status.FINISHED:
            assert a.blocks[:behind] == [SCRATCH_BLOCK] * behind and SCRATCH_BLOCK not in a.blocks[behind:], a.blocks
            most = max(most, s.pool.used)
    assert a.output == [100 + i for i in range(20)] and most <= 4
    assert s.pool.used == 0 and s.pool.available == s.pool.capacity
    s.add(b)  # the same prompt: with prefix caching, only the blocks still cached are reused
    run_all(s)
    assert b.output == [100, 101, 102] and s.pool.used == 0
    c = Seq("c", list(range(50, 64)), max_new=2)
    s.add(c)
    finish_step(s, s.schedule())
    finish_step(s, s.schedule())
    assert SCRATCH_BLOCK in c.blocks
    s._preempt(c)  # gives back only the blocks it still holds
    assert c.blocks == [] and s.pool.used == 0
    run_all(s)
    assert c.output == [100, 101] and s.pool.used == 0


def test_interactive_sequences_go_before_background_ones() -> None:
    """Priority (issue 42's batches): a waiting interactive sequence is queued ahead of background
    ones and, when max_batch is taken by background work, preempts the most recent of it to be
    admitted at once, alone in its prefill step (the background row sits it out); the preempted
    one waits ahead of later background work and finishes later."""
    s = make(max_batch=2, token_budget=64, n_blocks=64)
    a, b, c = Seq("bg-a", [1] * 6, priority=1), Seq("bg-b", [2] * 6, priority=1), Seq("bg-c", [3] * 6, priority=1)
    for seq in (a, b, c):
        s.add(seq)
    finish_step(s, s.schedule())
    assert s.running == [a, b] and list(s.waiting) == [c]
    user = Seq("user", [4] * 5)
    s.add(user)
    assert list(s.waiting) == [user, c]
    step = s.schedule()
    assert [q for q, _ in step.prefill] == [user] and step.decode == []
    assert s.running == [a, user] and list(s.waiting) == [b, c] and b.num_computed == 0 and s.preemptions == 1
    done: list[Seq] = []
    for _ in range(40):
        done += finish_step(s, s.schedule())
        if not s.has_work:
            break
    order = [q.request_id for q in done]
    assert sorted(order) == ["bg-a", "bg-b", "bg-c", "user"] and order.index("user") < order.index("bg-b")
    assert s.pool.used == 0


def test_the_pool_takes_background_blocks_first() -> None:
    """When the pool runs dry, the victims are the most recently admitted background sequences,
    even when an interactive sequence was admitted after them."""
    s = make(max_batch=4, token_budget=64, n_blocks=9, block_size=4)  # 8 usable blocks
    bg = Seq("bg", [1] * 12, max_new=20, priority=1)
    s.add(bg)
    finish_step(s, s.schedule())
    user = Seq("user", [2] * 12, max_new=20)
    s.add(user)
    finish_step(s, s.schedule())
    assert s.running == [bg, user]
    for _ in range(12):  # both grow until the pool is short: the background one gives way
        finish_step(s, s.schedule())
        if bg.status is Status.WAITING:
            break
    assert bg.status is Status.WAITING and user.status is Status.RUNNING and s.preemptions >= 1
