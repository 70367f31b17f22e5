"""The engine loop on rank 0: the only thread that touches the engine and the other ranks.

Front ends (through serve/core/generation.py) `submit()` tickets and `cancel()` them; the loop's
thread, in turn:

1. applies cancellations (client gone, deadline passed) - the engine frees its KV blocks and the
   sequence leaves the batch at the next step;
2. hands queued tickets to the engine while it has room (`engine.max_batch`, which the engine's
   scheduler enforces; the loop only meters tickets to it, because a ticket's adapter must be
   made resident as it joins). The engine prefills them within its per-step token budget, next
   to the running decodes;
3. runs one engine step (a collective: the plan is broadcast to every rank) and hands each
   event to its ticket's queue;
   Tickets join in arrival order, whatever their LoRA adapter: each row of a batch is routed
   to its request's adapter (tprt.lora.routing), so base-model and adapter requests share steps.
   A ticket's adapter is made resident on the device as it joins (serve/adapters/pool.py); when
   the pool cannot make room, the ticket waits and later ones go ahead, except those for the
   adapter that will make room next (so that its rows drain: a waiting adapter is never
   starved by steady traffic to the loaded ones);
4. between generation steps, gives side work (a fine-tuning step) its turn: whenever
   generation is idle, and at least every `side_every_s` while it is busy; an exception from
   side work fails that work alone (`SideWork.fail`), unless a collective failed (the ranks'
   `failed`), which breaks the world as a failed step does;
5. runs control calls handed to it (`call`: loading an adapter) and removes adapters being
   unloaded once their requests have finished;
6. when there is nothing to do, sleeps until a submission, and sends a keepalive to the
   followers every `keepalive_s`.

The queue is bounded: `submit()` raises QueueFull (RESOURCE_EXHAUSTED) at once when `max_queue`
interactive tickets would wait (beyond those that take a free slot at the next step). Background
tickets (a batch's requests, `priority` BACKGROUND) queue behind every interactive one, are not
counted (their runner keeps a few in flight), and run in the room interactive work leaves. If a step fails (a rank died, a collective timed out) the world is
*broken*: every ticket fails with UNAVAILABLE, new ones are refused, and the thread stops
issuing collectives.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve.adapters.pool import AdapterPool
from serve.errors import QueueFull, ServeError, Unavailable
from serve.metrics import Metrics
from serve.router_metrics import RouterFacts
from tprt.distributed.ranks import RankGroup
from tprt.engine.scheduler import KVStats
from tprt.errors import ValidationError
from tprt.engine.sampling import SamplingParams
from tprt.engine.sequence import TokenEvent

log = logging.getLogger("tprt.serve")


class EngineLike(Protocol):
    """What the engine loop uses of a `tprt.engine.core.Engine`: a fake one can drive it."""

    @property
    def has_work(self) -> bool: ...

    @property
    def max_batch(self) -> int:
        """Sequences the engine's scheduler runs at once (EngineConfig.max_batch)."""
        ...

    @property
    def num_unfinished(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def kv_stats(self) -> KVStats: ...

    def unfinished_at(self, priority: int) -> int: ...

    def add(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str, adapter: int = 0,
            priority: int = 0) -> None: ...

    def cancel(self, request_id: str) -> bool: ...

    def step(self) -> list[TokenEvent]: ...


class SideWork(Protocol):
    """Work that shares the ranks with generation (fine-tuning): one short collective step at a time."""

    def has_work(self) -> bool: ...

    def step(self, ranks: RankGroup) -> None: ...

    def fail(self, ranks: RankGroup, error: Exception) -> None:
        """`step` raised `error` while the ranks were sound: end the work it was doing (a job
        fails alone; serving goes on)."""
        ...


class EventSink(Protocol):
    """Where the loop's thread puts a ticket's events (a thread-safe put): a queue.SimpleQueue
    for a thread that waits, or one that hands them into an asyncio event loop."""

    def put(self, item: Any, /) -> None: ...


@dataclass
class Ticket:
    """One sequence of a generation request, between its front end and the engine loop."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    adapter_id: str = ""
    adapter_index: int = 0  # where the ranks hold that adapter (tprt.lora.routing); 0: the base model
    deadline: float | None = None  # time.monotonic() after which it is cancelled
    events: EventSink = field(default_factory=queue.SimpleQueue)
    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    last_token: float | None = None
    cancel_reason: str = ""  # why the server cancelled it ("client", "deadline", "shutdown")
    done: bool = False  # its front end saw its last event or error (that front end's side only)
    # 0: interactive; BACKGROUND: a batch's request, queued behind every interactive ticket and run
    # in what interactive traffic leaves (tprt.engine.scheduler), not counted against max_queue
    # (its runner meters them)
    priority: int = 0


BACKGROUND = 1


_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}-{time.monotonic_ns() % 1_000_000:06d}"


class EngineLoop:
    """Owns the engine on rank 0 (see the module docstring)."""

    def __init__(self, engine: EngineLike, ranks: RankGroup, metrics: Metrics, max_queue: int,
                 keepalive_s: float = 2.0, side_every_s: float = 1.0,
                 on_broken: Callable[[str], None] | None = None, adapters: AdapterPool | None = None) -> None:
        self.engine = engine
        self.ranks = ranks
        self.metrics = metrics
        self._kv_seen = engine.kv_stats  # what the metrics' KV counters have counted so far
        self._spec_seen = getattr(engine, "spec_stats", None)  # and the speculative ones (None: off)
        self.max_queue = max_queue
        self.keepalive_s = keepalive_s
        self.side_every_s = side_every_s
        self.side: SideWork | None = None
        self.after_step: Callable[[], None] | None = None  # runs after each step (KV-cache events' hand-over)
        # Resolves tickets' adapters to device indices as they join (None: the ticket's own index).
        self.adapters = adapters
        self._on_broken = on_broken
        self._calls: list[tuple[Callable[[RankGroup], Any], Future[Any]]] = []
        self._cv = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._cancels: list[tuple[str, str]] = []  # (request_id, reason)
        self._live: dict[str, Ticket] = {}  # in the engine
        self._accepting = True
        self._stop = False
        self.broken: str | None = None
        self._last_side = 0.0
        self._thread = threading.Thread(target=self._run, name="tprt-engine-loop", daemon=True)
        self._side_wake = False

    # ----------------------------------------------------------------- front-end side

    def start(self) -> None:
        self._thread.start()

    def submit(self, ticket: Ticket) -> None:
        """Queues a ticket; QueueFull when the queue is full, Unavailable when shutting down or
        broken, NotFound when it names an adapter the pool does not know."""
        pooled = bool(ticket.adapter_id) and self.adapters is not None
        if pooled:
            assert self.adapters is not None
            self.adapters.acquire(ticket.adapter_id)
        try:
            with self._cv:
                if self.broken is not None:
                    raise Unavailable(f"the server cannot generate: {self.broken}")
                if not self._accepting:
                    raise Unavailable("the server is shutting down; retry on another replica")
                if ticket.priority == 0:
                    free_slots = max(0, self.engine.max_batch - self._live_interactive())  # join at the next step
                    waiting = sum(1 for t in self._waiting if t.priority == 0)
                    if waiting >= self.max_queue + free_slots:
                        raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
                at = len(self._waiting)  # behind every ticket of its priority or a more urgent one
                while at > 0 and self._waiting[at - 1].priority > ticket.priority:
                    at -= 1
                self._waiting.insert(at, ticket)
                self.metrics.waiting.set(len(self._waiting))
                self._cv.notify()
        except ServeError:
            if pooled:
                self._release_adapter(ticket)
            raise

    def call(self, fn: Callable[[RankGroup], Any]) -> Future[Any]:
        """Runs `fn(ranks)` on the loop's thread between steps (it may send commands to the
        ranks); the future holds its result or error."""
        future: Future[Any] = Future()
        with self._cv:
            if self.broken is not None:
                future.set_exception(Unavailable(f"the server cannot run commands: {self.broken}"))
                return future
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def cancel(self, request_id: str, reason: str = "client") -> None:
        """Takes the request out of the queue or the batch at the next step (no-op when finished)."""
        with self._cv:
            self._cancels.append((request_id, reason))
            self._cv.notify()

    def wake(self) -> None:
        """Side work is waiting (e.g. a new fine-tuning job)."""
        with self._cv:
            self._side_wake = True
            self._cv.notify()

    @property
    def in_flight(self) -> int:
        with self._cv:
            return len(self._waiting) + len(self._live)

    def stop_accepting(self) -> None:
        with self._cv:
            self._accepting = False

    def drain(self, timeout_s: float) -> bool:
        """Stops accepting and waits up to `timeout_s` for queued and running requests to finish;
        cancels whatever is left (reason "shutdown"). True when everything finished in time."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline and self.broken is None:
            time.sleep(0.02)
        clean = self.in_flight == 0
        if not clean:
            with self._cv:
                ids = [t.request_id for t in self._waiting] + list(self._live)
            for rid in ids:
                self.cancel(rid, "shutdown")
            end = time.monotonic() + 5.0
            while self.in_flight and time.monotonic() < end and self.broken is None:
                time.sleep(0.02)
        return clean

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops the thread after its current step; it then releases the followers (EXIT)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout_s)

    def mark_broken(self, reason: str) -> None:
        """The world is unusable: fail every ticket with UNAVAILABLE and refuse new ones."""
        with self._cv:
            if self.broken is not None:
                return
            self.broken = reason
            tickets = list(self._waiting) + list(self._live.values())
            calls, self._calls = self._calls, []
            self._waiting.clear()
            self._live.clear()
            self._cv.notify()
        log.error("serving stopped: %s", reason)
        for t in tickets:
            self._release_adapter(t)
            t.events.put(Unavailable(f"the server cannot generate: {reason}"))
        for _, future in calls:
            future.set_exception(Unavailable(f"the server cannot run commands: {reason}"))
        self.metrics.waiting.set(0)
        self.metrics.running.set(0)
        if self._on_broken is not None:
            self._on_broken(reason)

    # ----------------------------------------------------------------- the loop's thread

    def _run(self) -> None:
        try:
            while self._iteration():
                pass
            if self.broken is None:
                self.ranks.exit()
        except Exception as e:  # noqa: BLE001 - a failed collective: the world is broken
            log.exception("engine loop stopped")
            self.mark_broken(f"{type(e).__name__}: {e}".splitlines()[0])

    def _iteration(self) -> bool:
        """One pass of the loop; False when the thread should end."""
        cancels = self._take_work()
        if self.broken is not None:
            return False
        self._run_calls()
        self._admit_waiting()  # before the cancellations, which may name a ticket admitted just now
        for rid, reason in cancels:
            self._apply_cancel(rid, reason)
        self._expire_deadlines()
        ran = False
        if self.engine.has_work:
            self._step()
            ran = True
        side = self.side
        if side is not None and side.has_work():
            due = time.monotonic() - self._last_side >= self.side_every_s
            if not ran or due:
                self._side_step(side)
                self._last_side = time.monotonic()
                ran = True
        if self.adapters is not None:
            self.adapters.finish_unloads(self.ranks)
        if not ran and time.monotonic() - self.ranks.last_collective >= self.keepalive_s:
            self.ranks.keepalive()
        with self._cv:
            return not (self._stop and not self._live and not self._waiting)

    def _side_step(self, side: SideWork) -> None:
        """One turn of side work. An error of the work's own (a job's store write, its adapter)
        fails that work alone; one of the ranks' collectives breaks the world (re-raised)."""
        try:
            side.step(self.ranks)
        except Exception as e:  # noqa: BLE001 - see above
            if self.ranks.failed is not None:
                raise
            log.error("side work failed, serving goes on: %s", f"{type(e).__name__}: {e}".splitlines()[0])
            log.debug("side work failure", exc_info=True)
            side.fail(self.ranks, e)

    def _take_work(self) -> list[tuple[str, str]]:
        """Waits for something to do (bounded by the keepalive); takes the cancellations."""
        with self._cv:
            idle = not (self._waiting or self._cancels or self._stop or self._side_wake or self._calls
                        or self.engine.has_work)
            side_busy = self.side is not None and self.side.has_work()
            if idle and not side_busy:
                self._cv.wait(self.keepalive_s)
            self._side_wake = False
            cancels, self._cancels = self._cancels, []
            return cancels

    def _run_calls(self) -> None:
        with self._cv:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                future.set_result(fn(self.ranks))
            except Exception as e:  # noqa: BLE001 - the caller's; a broken world shows at the next step
                future.set_exception(e)

    def router_facts(self, max_lora: int) -> RouterFacts:
        """What routers read of this server (serve/router_metrics.py): its queue and batch, the KV
        pool as of the last step, and the adapters of running and waiting requests."""
        with self._cv:
            live, waiting = list(self._live.values()), list(self._waiting)
        kv = self._kv_seen
        return RouterFacts(len(waiting), len(live), kv.blocks_used / max(kv.blocks_total, 1), kv.block_size,
                           kv.blocks_total, max_lora, tuple(sorted({t.adapter_id for t in live if t.adapter_id})),
                           tuple(sorted({t.adapter_id for t in waiting if t.adapter_id})))

    def _live_interactive(self) -> int:
        return sum(1 for t in self._live.values() if t.priority == 0)

    def _admit_waiting(self) -> None:
        """Moves queued tickets into the engine, in order, while it has room; a ticket whose
        adapter cannot be made resident now stays queued, ahead of later arrivals, and later
        tickets for the adapter that will make room next wait too, so that its rows drain.
        Interactive tickets count only interactive work as taking room: the engine's scheduler
        preempts background sequences for them."""
        room = self.engine.max_batch - self.engine.num_unfinished
        room_interactive = self.engine.max_batch - self.engine.unfinished_at(0)
        deferred: list[Ticket] = []
        draining: set[str] = set()  # adapters whose new tickets wait so that one can be evicted
        while room_interactive > 0:
            with self._cv:
                if not self._waiting or (self._waiting[0].priority != 0 and room <= 0):
                    break
                t = self._waiting.popleft()
                self._live[t.request_id] = t  # so that a cancellation finds it while it resolves
            if t.adapter_id in draining:
                deferred.append(t)
                continue
            resolved = self._resolve_adapter(t)
            if resolved:
                self._admit(t)
                room -= 1
                if t.priority == 0:
                    room_interactive -= 1
            elif resolved is not None:
                deferred.append(t)
                victim = self.adapters.next_eviction() if self.adapters is not None else None
                if victim is not None:
                    draining.add(victim)
        with self._cv:
            for t in deferred:
                self._live.pop(t.request_id, None)
            self._waiting.extendleft(reversed(deferred))
            if deferred:  # still interactive first (a stable sort)
                self._waiting = deque(sorted(self._waiting, key=lambda t: t.priority))
            self.metrics.waiting.set(len(self._waiting))

    def _resolve_adapter(self, t: Ticket) -> bool | None:
        """Sets the ticket's adapter index from the pool (loading the adapter if needed): True;
        False when it must wait for room; None when it failed (the ticket got the error)."""
        if not t.adapter_id or self.adapters is None:
            return True
        try:
            index = self.adapters.make_resident(self.ranks, t.adapter_id)
        except ServeError as e:
            self._fail(t, e)
            return None
        if index is None:
            return False
        t.adapter_index = index
        return True

    def _fail(self, t: Ticket, error: BaseException) -> None:
        with self._cv:
            self._live.pop(t.request_id, None)
        self._release_adapter(t)
        t.events.put(error)

    def _release_adapter(self, t: Ticket) -> None:
        if t.adapter_id and self.adapters is not None:
            self.adapters.release(t.adapter_id, t.admitted is not None)

    def _admit(self, t: Ticket) -> None:
        try:
            self.engine.add(t.prompt, t.params, t.request_id, adapter=t.adapter_index, priority=t.priority)
        except ValidationError as e:  # checked by the front end already; a race or a bug
            self._fail(t, e)
            return
        if t.adapter_id and self.adapters is not None:
            self.adapters.registry.start(t.adapter_id)
        t.admitted = time.monotonic()
        self.metrics.queue_time.observe(t.admitted - t.arrival)
        self.metrics.prompt_tokens.inc(len(t.prompt))

    def _apply_cancel(self, rid: str, reason: str) -> None:
        with self._cv:
            for t in self._waiting:
                if t.request_id == rid:
                    self._waiting.remove(t)
                    t.cancel_reason = reason
                    self._release_adapter(t)
                    t.events.put(TokenEvent(rid, None, "", finish_reason="cancelled"))
                    return
            t2 = self._live.get(rid)
        if t2 is not None:
            t2.cancel_reason = reason
            self.engine.cancel(rid)  # its "cancelled" event comes with the next step

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        with self._cv:
            late = [t.request_id for t in [*self._waiting, *self._live.values()]
                    if t.deadline is not None and now > t.deadline and not t.cancel_reason]
        for rid in late:
            self._apply_cancel(rid, "deadline")

    def _step(self) -> None:
        t0 = time.monotonic()
        running = self.engine.num_unfinished
        events = self.engine.step()
        now = time.monotonic()
        self.ranks.stepped()
        self.metrics.steps.inc()
        self.metrics.step_time.observe(now - t0)
        if running:
            self.metrics.batch_size.observe(running)
            with self._cv:
                adapters = {t.adapter_id for t in self._live.values() if t.adapter_id and t.admitted is not None}
            self.metrics.adapters_per_step.observe(len(adapters))
        for ev in events:
            self._deliver(ev, now)
        if self.after_step is not None:
            self.after_step()
        self._update_gauges()

    def _deliver(self, ev: TokenEvent, now: float) -> None:
        with self._cv:
            t = self._live.get(ev.request_id)
            if t is not None and ev.finish_reason is not None:
                del self._live[ev.request_id]
        if t is None:
            return
        if ev.finish_reason is not None:
            self._release_adapter(t)
        if ev.token_id is not None:
            self.metrics.generated_tokens.inc()
            if t.adapter_id:
                self.metrics.adapter_tokens.labels(adapter=t.adapter_id).inc()
            if t.last_token is None:
                self.metrics.ttft.observe(now - t.arrival)
            else:
                self.metrics.itl.observe(now - t.last_token)
            t.last_token = now
        if ev.finish_reason is not None:
            if ev.usage is not None:
                self.metrics.cached_prompt_tokens.inc(ev.usage.cached_prompt_tokens)
            if ev.finish_reason != "cancelled":
                self.metrics.e2e.observe(now - t.arrival)
        t.events.put(ev)

    def _update_gauges(self) -> None:
        m, kv = self.metrics, self.engine.kv_stats
        m.running.set(self.engine.num_unfinished)
        m.kv_usage.set(kv.blocks_used / kv.blocks_total)  # the engine keeps the counts
        for state, n in (("used", kv.blocks_used), ("cached", kv.blocks_cached),
                         ("free", kv.blocks_total - kv.blocks_used - kv.blocks_cached)):
            m.kv_blocks.labels(state).set(n)
        # The engine counts since it started; the counters advance by what is new.
        last = self._kv_seen
        m.prefix_queries.inc(kv.prefix_queried_tokens - last.prefix_queried_tokens)
        m.prefix_hits.inc(kv.prefix_hit_tokens - last.prefix_hit_tokens)
        m.preemptions.inc(kv.preemptions - last.preemptions)
        self._kv_seen = kv
        spec = getattr(self.engine, "spec_stats", None)
        if spec is not None and self._spec_seen is not None:
            m.speculation(spec, self._spec_seen)
            self._spec_seen = spec
