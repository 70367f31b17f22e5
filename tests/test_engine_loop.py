"""serve.core.loop.EngineLoop on its own: its thread driving a fake engine, no ranks, no server.

The fake engine's step() waits until the test lets it run (`FakeEngine.run_steps`), so each test
decides exactly what happens between two steps: submissions, cancellations, deadlines passing.
Covered: arrival-order admission up to --max-batch-size, the bounded queue (QueueFull, i.e.
RESOURCE_EXHAUSTED), cancellation of queued and running tickets (the slot goes to the next
ticket), deadlines, drain, a failed step breaking the world, events and metrics, idle keepalives,
side work and the "exit" command at shutdown.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from serve.errors import QueueFull, Status, Unavailable
from serve.metrics import Metrics
from serve.core.loop import BACKGROUND, EngineLoop, Ticket
from tprt.engine.core import KVStats
from tprt.engine.sampling import SamplingParams
from tprt.engine.sequence import TokenEvent, Usage
from tprt.errors import ValidationError

WAIT_S = 10.0  # upper bound of every wait; a passing test never waits this long
FOREVER = 10**9  # max_new_tokens of a request that only ends when cancelled


# ----------------------------------------------------------------- fakes


class FakeEngine:
    """serve.core.loop.EngineLike: has_work, max_batch, num_unfinished, max_seq_len, kv_stats, add,
    cancel, step. A running request gets one token per step (ids 1, 2, ...)
    until max_new_tokens; a cancellation frees its KV at once and is reported by the next step,
    as the real engine does. step() blocks until `run_steps` (or `run_freely`) lets it go."""

    max_seq_len = 64

    def __init__(self, max_batch: int = 2) -> None:
        self.max_batch = max_batch  # as EngineConfig.max_batch: the loop hands over no more than this
        self.added: list[tuple[str, int]] = []  # (request id, adapter index), in admission order
        self.cancelled: list[str] = []
        self.refuse: set[str] = set()  # request ids add() refuses (as it does a request it finds invalid)
        self.fail: Exception | None = None  # raised by the next step
        self.max_running = 0
        self._left: dict[str, int] = {}  # running request -> tokens still to generate
        self._made: dict[str, int] = {}
        self._prompt_len: dict[str, int] = {}
        self._pending: list[TokenEvent] = []
        self._permits = threading.Semaphore(0)
        self._free = False
        self._cv = threading.Condition()
        self.calls = 0  # step() entered
        self.steps = 0  # step() returned
        self.priority: dict[str, int] = {}  # request id -> the priority it was added with

    @property
    def has_work(self) -> bool:
        return bool(self._left or self._pending)

    @property
    def num_unfinished(self) -> int:
        return len(self._left)

    kv_capacity = 16 * max_seq_len

    @property
    def kv_tokens(self) -> int:
        return sum(self._prompt_len[rid] + self._made[rid] for rid in self._left)

    @property
    def kv_stats(self) -> KVStats:  # blocks of one position, nothing cached, shared or preempted
        return KVStats(1, self.kv_tokens, 0, self.kv_capacity, 0, 0, 0)

    def unfinished_at(self, priority: int) -> int:
        return sum(1 for rid in self._left if self.priority.get(rid, 0) == priority)

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str, adapter: int = 0,
            priority: int = 0) -> None:
        if request_id in self.refuse:
            raise ValidationError("max_new_tokens", "too long for the context")
        self.added.append((request_id, adapter))
        self.priority[request_id] = priority
        self._left[request_id] = params.max_new_tokens
        self._made[request_id] = 0
        self._prompt_len[request_id] = len(prompt_ids)

    def cancel(self, request_id: str) -> bool:
        if request_id not in self._left:
            return False
        del self._left[request_id]
        self.cancelled.append(request_id)
        self._pending.append(TokenEvent(request_id, None, "", finish_reason="cancelled", usage=self._usage(request_id)))
        return True

    def step(self) -> list[TokenEvent]:
        with self._cv:
            self.calls += 1
            self._cv.notify_all()
        if not self._free and not self._permits.acquire(timeout=WAIT_S):
            raise AssertionError("the test never let this step run")
        if self.fail is not None:
            raise self.fail
        events, self._pending = self._pending, []
        self.max_running = max(self.max_running, len(self._left))
        for rid in list(self._left):
            self._made[rid] += 1
            self._left[rid] -= 1
            n = self._made[rid]
            if self._left[rid] == 0:
                del self._left[rid]
                events.append(TokenEvent(rid, n, f"t{n}", finish_reason="length", usage=self._usage(rid)))
            else:
                events.append(TokenEvent(rid, n, f"t{n}"))
        with self._cv:
            self.steps += 1
            self._cv.notify_all()
        return events

    def _usage(self, rid: str) -> Usage:
        return Usage(self._prompt_len[rid], self._made[rid], cached_prompt_tokens=1)

    # ------------------------------------------------------------- the test's controls

    def wait_parked(self, calls: int = 1) -> None:
        """Until the scheduler has entered step() `calls` times (it waits there for a permit)."""
        with self._cv:
            assert self._cv.wait_for(lambda: self.calls >= calls, WAIT_S), "the scheduler never stepped"

    def run_steps(self, n: int = 1) -> None:
        """Lets n steps run; returns when the scheduler is back in step() (so everything those
        steps produced was delivered, and the next admissions and cancellations are done) or
        has nothing left to step."""
        with self._cv:
            target = self.steps + n
            for _ in range(n):
                self._permits.release()
            done = self._cv.wait_for(lambda: self.calls > target or (self.steps >= target and not self.has_work),
                                     WAIT_S)
            assert done, f"{n} steps did not run"

    def run_freely(self) -> None:
        """From now on step() never waits."""
        self._free = True
        self._permits.release()


class FakeRanks:
    """The part of tprt.distributed.ranks.RankGroup the scheduler uses: exit, keepalive, stepped,
    last_collective."""

    def __init__(self) -> None:
        self.commands: list[str] = []  # what was sent besides steps and keepalives, in order
        self.keepalives = 0
        self.last_collective = time.monotonic()
        self.failed: str | None = None  # a collective failed (RankGroup.failed)

    def exit(self) -> None:
        self.commands.append("exit")
        self.last_collective = time.monotonic()

    def keepalive(self) -> None:
        self.keepalives += 1
        self.last_collective = time.monotonic()

    def stepped(self) -> None:
        self.last_collective = time.monotonic()

    def run(self, cmd: Any) -> Any:
        """An adapter command of serve/adapters/pool.py: loads answer as the ranks would."""
        from serve.ranks.commands import AdapterLoaded, LoadAdapter

        self.commands.append(type(cmd).__name__)
        return AdapterLoaded(4, 8.0, cmd.index, ("q",)) if isinstance(cmd, LoadAdapter) else None


class FakeSideWork:
    """Fine-tuning's place in the scheduler (serve.core.loop.SideWork): `turns` steps of work;
    a step raises `error` when one is set (then `fail` records it and ends the work)."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.ranks_seen: list[Any] = []
        self.done = threading.Event()
        self.error: Exception | None = None
        self.failed: list[Exception] = []

    def has_work(self) -> bool:
        return self.turns > 0

    def step(self, ranks: Any) -> None:
        self.ranks_seen.append(ranks)
        if self.error is not None:
            raise self.error
        self.turns -= 1
        if self.turns == 0:
            self.done.set()

    def fail(self, ranks: Any, error: Exception) -> None:
        self.failed.append(error)
        self.turns = 0
        self.done.set()


# ----------------------------------------------------------------- helpers


class World:
    """A scheduler over the fakes, with the broken-world callback recorded."""

    def __init__(self, max_batch: int, max_queue: int, keepalive_s: float, adapters: Any = None) -> None:
        self.engine = FakeEngine(max_batch)
        self.ranks = FakeRanks()
        self.metrics = Metrics()
        self.broken: list[str] = []
        self.scheduler = EngineLoop(self.engine, self.ranks, self.metrics, max_queue=max_queue,
                                    keepalive_s=keepalive_s, on_broken=self.broken.append, adapters=adapters)
        self.started = False

    def start(self) -> None:
        self.scheduler.start()
        self.started = True

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        assert value is not None, name
        return value


@pytest.fixture
def world() -> Iterator[Callable[..., World]]:
    made: list[World] = []

    def make(max_batch: int = 2, max_queue: int = 2, keepalive_s: float = 5.0, adapters: Any = None) -> World:
        made.append(World(max_batch, max_queue, keepalive_s, adapters))
        return made[-1]

    yield make
    for w in (w for w in made if w.started):  # end whatever a test left running
        w.engine.run_freely()
        w.scheduler.drain(0)
        w.scheduler.shutdown(WAIT_S)


def ticket(name: str, new_tokens: int = 3, prompt: int = 4, adapter: int = 0, deadline: float | None = None,
           adapter_id: str = "") -> Ticket:
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    return Ticket(name, list(range(1, prompt + 1)), params, adapter_id, adapter_index=adapter, deadline=deadline)


def events(t: Ticket) -> list[TokenEvent]:
    """The ticket's events up to its last one."""
    out: list[TokenEvent] = []
    while not out or out[-1].finish_reason is None:
        ev = t.events.get(timeout=WAIT_S)
        assert not isinstance(ev, BaseException), ev
        out.append(ev)
    return out


def wait_for(pred: Callable[[], Any], what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


# ----------------------------------------------------------------- tests


def test_tickets_join_in_arrival_order_up_to_max_batch(world: Callable[..., World]) -> None:
    w = world(max_batch=2, max_queue=4)
    tickets = [ticket("a", 1, adapter=3), ticket("b", 3), ticket("c", 1), ticket("d", 2)]
    for t in tickets:
        w.scheduler.submit(t)
    w.start()
    w.engine.wait_parked()
    assert w.engine.added == [("a", 3), ("b", 0)]  # the rest wait: the batch is full
    assert w.metric("tprt_waiting_requests") == 2
    w.engine.run_steps()  # a finishes; c takes its slot
    assert [rid for rid, _ in w.engine.added] == ["a", "b", "c"]
    w.engine.run_steps(3)
    assert [rid for rid, _ in w.engine.added] == ["a", "b", "c", "d"]
    assert w.engine.max_running == 2
    # Every ticket got its own tokens in order, the last one with the finish reason and usage.
    for t in tickets:
        evs = events(t)
        assert [e.token_id for e in evs] == list(range(1, t.params.max_new_tokens + 1))
        assert [e.finish_reason for e in evs] == [None] * (len(evs) - 1) + ["length"]
        assert evs[-1].usage == Usage(4, t.params.max_new_tokens, 1)
        assert {e.request_id for e in evs} == {t.request_id}


def test_a_full_queue_refuses_with_resource_exhausted(world: Callable[..., World]) -> None:
    w = world(max_batch=1, max_queue=1)
    w.scheduler.submit(ticket("running", FOREVER))
    w.start()
    w.engine.wait_parked()  # "running" holds the only slot
    w.scheduler.submit(ticket("queued"))
    with pytest.raises(QueueFull) as info:
        w.scheduler.submit(ticket("one too many"))
    assert info.value.status == Status.RESOURCE_EXHAUSTED and "queue is full" in str(info.value)
    assert w.metric("tprt_waiting_requests") == 1 and w.scheduler.in_flight == 2


def test_background_tickets_wait_behind_interactive_ones_and_are_not_queue_limited(
        world: Callable[..., World]) -> None:
    """A batch's tickets (BACKGROUND) are not counted against max_queue, queue behind every
    interactive ticket, and do not keep an interactive ticket out of the engine: it is handed
    over while background work fills max_batch (the engine's scheduler then preempts that work)."""
    w = world(max_batch=2, max_queue=1)
    background = [replace(ticket(f"bg-{i}", FOREVER), priority=BACKGROUND) for i in range(5)]
    for t in background:  # more than max_batch + max_queue: none refused
        w.scheduler.submit(t)
    w.start()
    w.engine.wait_parked()
    assert [rid for rid, _ in w.engine.added] == ["bg-0", "bg-1"]
    users = [ticket(f"user-{i}", 2) for i in range(3)]
    for t in users:  # max_batch counts interactive tickets only: two take free slots, one the queue place
        w.scheduler.submit(t)
    with pytest.raises(QueueFull):
        w.scheduler.submit(ticket("one too many"))
    w.engine.run_steps(1)
    assert [rid for rid, _ in w.engine.added][2:] == ["user-0", "user-1"]  # ahead of bg-2 .. bg-4
    assert w.engine.priority["user-0"] == 0 and w.engine.priority["bg-0"] == BACKGROUND
    w.engine.run_freely()
    for t in users:
        assert events(t)[-1].finish_reason == "length"
    for t in background:
        w.scheduler.cancel(t.request_id)


def test_router_facts_name_the_adapters_of_running_and_waiting_requests(world: Callable[..., World]) -> None:
    """What routers scrape (serve/router_metrics.py, issue 43): the queue, the batch, and the
    adapters of running and of waiting requests."""
    w = world(max_batch=1, max_queue=4)
    w.scheduler.submit(ticket("run", FOREVER, adapter_id="lora-a"))
    w.start()
    w.engine.wait_parked()
    w.scheduler.submit(ticket("wait", adapter_id="lora-b"))
    w.scheduler.submit(ticket("base"))
    facts = w.scheduler.router_facts(max_lora=8)
    assert (facts.running, facts.waiting, facts.max_lora) == (1, 2, 8)
    assert (facts.running_adapters, facts.waiting_adapters) == (("lora-a",), ("lora-b",))
    assert 0 <= facts.kv_usage <= 1 and facts.block_size == 1
    w.scheduler.cancel("run")


def test_tickets_that_take_a_free_slot_next_step_are_not_counted_as_queued(world: Callable[..., World]) -> None:
    w = world(max_batch=2, max_queue=1)  # not started: nothing is admitted yet
    for name in ("a", "b", "c"):  # two free slots + one queue place
        w.scheduler.submit(ticket(name))
    with pytest.raises(QueueFull):
        w.scheduler.submit(ticket("d"))


def test_cancelling_frees_the_slot_and_the_queue_place(world: Callable[..., World]) -> None:
    w = world(max_batch=1, max_queue=1)
    running, queued = ticket("running", FOREVER), ticket("queued", FOREVER)
    w.scheduler.submit(running)
    w.start()
    w.engine.wait_parked()
    w.scheduler.submit(queued)
    # A queued ticket leaves the queue without reaching the engine; its place takes another.
    w.scheduler.cancel("queued")
    w.engine.run_steps()
    assert [e.finish_reason for e in events(queued)] == ["cancelled"] and queued.cancel_reason == "client"
    assert w.engine.added == [("running", 0)]
    later = ticket("later", 2)
    w.scheduler.submit(later)
    # A running ticket: the engine frees its slot, the next step reports it, the next ticket joins.
    w.scheduler.cancel("running", "client")
    w.engine.run_steps()
    assert w.engine.cancelled == ["running"] and running.cancel_reason == "client"  # its slot is free now
    w.engine.run_steps()  # which this step reports, and "later" joins
    evs = events(running)
    assert evs[-1].token_id is None and evs[-1].finish_reason == "cancelled"
    assert [rid for rid, _ in w.engine.added] == ["running", "later"]
    w.engine.run_steps(2)
    assert [e.finish_reason for e in events(later)] == [None, "length"]
    w.scheduler.cancel("later")  # already finished: nothing happens
    wait_for(lambda: w.metric("tprt_kv_cache_blocks", state="used") == 0 and w.metric("tprt_running_requests") == 0,
             "the gauges to show an empty batch")
    assert w.scheduler.in_flight == 0 and w.engine.cancelled == ["running"]


def test_deadlines_cancel_queued_and_running_tickets(world: Callable[..., World]) -> None:
    w = world(max_batch=1, max_queue=2)
    running = ticket("running", FOREVER, deadline=time.monotonic() + 3600)
    queued = ticket("queued", deadline=time.monotonic() - 1)  # already past when it is submitted
    w.scheduler.submit(running)
    w.start()
    w.engine.wait_parked()
    w.scheduler.submit(queued)
    w.engine.run_steps()  # the next pass expires the queued ticket without admitting it
    assert [e.finish_reason for e in events(queued)] == ["cancelled"] and queued.cancel_reason == "deadline"
    assert w.engine.added == [("running", 0)]
    running.deadline = time.monotonic() - 1  # its deadline passes while it runs
    w.engine.run_steps(2)
    assert w.engine.cancelled == ["running"] and running.cancel_reason == "deadline"
    assert events(running)[-1].finish_reason == "cancelled"
    assert w.scheduler.in_flight == 0


def test_drain_waits_for_requests_then_refuses_new_ones(world: Callable[..., World]) -> None:
    w = world()
    tickets = [ticket("a", 5), ticket("b", 7)]
    for t in tickets:
        w.scheduler.submit(t)
    w.start()
    w.engine.run_freely()
    assert w.scheduler.drain(WAIT_S) is True
    assert all(events(t)[-1].finish_reason == "length" for t in tickets)
    with pytest.raises(Unavailable, match="shutting down"):
        w.scheduler.submit(ticket("late"))
    w.scheduler.shutdown(WAIT_S)
    assert w.ranks.commands == ["exit"]  # the followers are released once the loop ends


def test_drain_cancels_what_outlives_its_timeout(world: Callable[..., World]) -> None:
    w = world(max_batch=1, max_queue=1)
    running, queued = ticket("running", FOREVER), ticket("queued")
    w.scheduler.submit(running)
    w.start()
    w.engine.wait_parked()
    w.scheduler.submit(queued)
    w.engine.run_freely()
    assert w.scheduler.drain(0.05) is False
    assert events(running)[-1].finish_reason == "cancelled" and running.cancel_reason == "shutdown"
    assert events(queued)[-1].finish_reason == "cancelled" and queued.cancel_reason == "shutdown"
    assert w.scheduler.in_flight == 0


def test_a_failed_step_breaks_the_world(world: Callable[..., World]) -> None:
    w = world(max_batch=1, max_queue=1)
    running, queued = ticket("running", FOREVER), ticket("queued")
    w.scheduler.submit(running)
    w.start()
    w.engine.wait_parked()
    w.scheduler.submit(queued)
    w.engine.fail = RuntimeError("collective timed out\nsecond line")
    w.engine.run_freely()
    for t in (running, queued):
        err = t.events.get(timeout=WAIT_S)
        assert isinstance(err, Unavailable) and "RuntimeError: collective timed out" in str(err)
    assert w.broken == ["RuntimeError: collective timed out"]
    with pytest.raises(Unavailable, match="cannot generate"):
        w.scheduler.submit(ticket("after"))
    w.scheduler.shutdown(WAIT_S)
    assert w.ranks.commands == []  # no collective is issued into a broken world


def test_a_ticket_the_engine_refuses_gets_the_error(world: Callable[..., World]) -> None:
    w = world()
    bad, good = ticket("bad"), ticket("good", 1)
    w.engine.refuse.add("bad")
    w.scheduler.submit(bad)
    w.scheduler.submit(good)
    w.start()
    w.engine.run_steps()
    err = bad.events.get(timeout=WAIT_S)
    assert isinstance(err, ValidationError) and err.field == "max_new_tokens"
    assert events(good)[-1].finish_reason == "length"
    assert w.scheduler.in_flight == 0


def test_metrics_count_tokens_latencies_and_gauges(world: Callable[..., World]) -> None:
    w = world(max_batch=2, max_queue=2)
    done, cancelled = ticket("done", 3, prompt=5), ticket("cancelled", FOREVER, prompt=2)
    w.scheduler.submit(done)
    w.scheduler.submit(cancelled)
    w.start()
    w.engine.run_steps()  # each has its first token
    assert w.metric("tprt_running_requests") == 2 and w.metric("tprt_kv_cache_blocks", state="used") == 5 + 1 + 2 + 1
    capacity = FakeEngine.kv_capacity  # the engine owns the count and the capacity
    assert w.metric("tprt_kv_cache_usage_ratio") == (5 + 1 + 2 + 1) / capacity  # prompts + generated
    w.engine.run_steps(2)  # "done" ends after its third token
    w.scheduler.cancel("cancelled")
    w.engine.run_steps(2)  # the cancellation is applied, then reported
    assert events(done)[-1].finish_reason == "length" and events(cancelled)[-1].finish_reason == "cancelled"
    wait_for(lambda: w.metric("tprt_running_requests") == 0, "the running gauge to drop")
    m = w.metric
    assert m("tprt_prompt_tokens_total") == 7
    assert m("tprt_generated_tokens_total") == 3 + 4  # "cancelled" got 4 tokens (it ran 4 steps)
    assert m("tprt_time_to_first_token_seconds_count") == 2
    assert m("tprt_inter_token_latency_seconds_count") == 2 + 3
    assert m("tprt_request_duration_seconds_count") == 1  # a cancelled request has no duration
    assert m("tprt_queue_time_seconds_count") == 2
    assert m("tprt_prompt_cached_tokens_total") == 2  # from each request's final usage
    assert m("tprt_engine_steps_total") == w.engine.steps
    assert m("tprt_batch_size_count") == 4  # the steps that had running sequences
    assert m("tprt_waiting_requests") == 0 and m("tprt_kv_cache_blocks", state="used") == 0
    assert m("tprt_kv_cache_usage_ratio") == 0


def test_idle_ranks_get_side_work_keepalives_and_exit(world: Callable[..., World]) -> None:
    w = world(keepalive_s=0.02)
    side = FakeSideWork(3)
    w.scheduler.side = side
    w.start()
    w.scheduler.wake()
    assert side.done.wait(WAIT_S)  # generation is idle: the side work takes every turn
    wait_for(lambda: w.ranks.keepalives >= 2, "keepalives while idle")
    assert side.ranks_seen == [w.ranks] * 3 and w.engine.calls == 0  # an idle engine is never stepped
    w.scheduler.shutdown(WAIT_S)
    assert w.ranks.commands == ["exit"]


def test_a_ticket_waiting_for_adapter_room_is_not_starved(world: Callable[..., World], tmp_path: Path) -> None:
    """One device slot, held by adapter a under a steady stream of a's requests: b's request waits
    for room, and a's requests after it wait too, so a's rows drain, a is evicted and b runs."""
    from serve.adapters.pool import ADAPTERS_DIR, AdapterPool
    from serve.adapters.registry import AdapterRegistry
    from tprt.lora.peft_io import adapter_config

    for name in "ab":
        (tmp_path / ADAPTERS_DIR / name).mkdir(parents=True)
        (tmp_path / ADAPTERS_DIR / name / "adapter_config.json").write_text(
            json.dumps(adapter_config(["q"], 4, 8.0, 0.0, None)))
    pool = AdapterPool(AdapterRegistry(), tmp_path, Metrics(), max_loras=1, max_cpu_loras=0)
    w = world(max_batch=4, max_queue=8, adapters=pool)
    first = ticket("a1", 2, adapter_id="a")
    w.scheduler.submit(first)
    w.start()
    w.engine.wait_parked()
    waiting = ticket("b1", 1, adapter_id="b")
    later = [ticket(f"a{i}", 2, adapter_id="a") for i in range(2, 5)]
    for t in [waiting, *later]:
        w.scheduler.submit(t)
    w.engine.run_steps()  # a1 still runs: b1 cannot get the slot, and a's later tickets wait behind it
    assert [rid for rid, _ in w.engine.added] == ["a1"]
    w.engine.run_steps()  # a1 ends: a is evicted, b1 joins; a's tickets wait for b1's rows to end
    assert [rid for rid, _ in w.engine.added] == ["a1", "b1"]
    w.engine.run_steps(2)
    assert [rid for rid, _ in w.engine.added] == ["a1", "b1", "a2", "a3", "a4"]
    w.engine.run_freely()
    assert all(events(t)[-1].finish_reason == "length" for t in [first, waiting, *later])


def test_an_error_in_side_work_fails_that_work_alone(world: Callable[..., World]) -> None:
    """A job's own error (its store, its adapter) ends the job; generation goes on. Only a failed
    collective (the ranks' `failed`) breaks the world."""
    w = world(keepalive_s=0.02)
    side = FakeSideWork(3)
    side.error = ValueError("the job's adapter could not be placed")
    w.scheduler.side = side
    w.start()
    w.scheduler.wake()
    assert side.done.wait(WAIT_S)
    assert [str(e) for e in side.failed] == ["the job's adapter could not be placed"] and w.broken == []
    w.engine.run_freely()
    t = ticket("after")
    w.scheduler.submit(t)
    assert events(t)[-1].finish_reason == "length"  # serving goes on

    broken = world(keepalive_s=0.02)
    side = FakeSideWork(3)
    side.error = RuntimeError("gloo: connection closed by peer")
    broken.ranks.failed = "RuntimeError: gloo: connection closed by peer"
    broken.scheduler.side = side
    broken.start()
    broken.scheduler.wake()
    wait_for(lambda: broken.broken, "the world to break")
    assert side.failed == [] and "connection closed" in broken.broken[0]
