"""The generation engine: a set of live sequences of different lengths, advanced one step at a time.

API (rank 0 drives, every other TP rank follows; over pipeline stages, every rank of the
pipeline: `Engine(stage_model, ..., pipeline=mesh)`, tprt.engine.stage_runner):

    engine = Engine(model, tokenizer, EngineConfig(max_batch=16))
    if engine.is_driver:                        # TP rank 0
        engine.add(prompt_ids, SamplingParams(...), "req-1")   # any time between steps
        while engine.has_work:
            for event in engine.step():         # TokenEvent: id, text delta, logprobs, finish
                ...
        engine.propose("req-1", draft_ids)      # optional: tokens to verify in its next row
        engine.cancel("req-1")                  # any time between steps; ends with a "cancelled" event
        engine.close()                          # releases the followers
    else:
        engine.follow()                         # executes rank 0's batches until close() (or a command)

A step is three beats, each owned by its own object:

1. schedule (tprt.engine.scheduler, plain data): admission, token budget, KV blocks, preemption
   and prefix sharing write one `tprt.model.batch.TokenBatch`: every decoding sequence's last
   token and its draft, and prompt chunks, flat. Before it, the speculative decoder
   (tprt.engine.speculative) drafts for decoding rows, and the structured-output manager
   (tprt.engine.structured) holds back rows whose masks cost too much.
2. execute: the batch goes to the other ranks as a STEP message of the rank protocol
   (tprt.distributed.protocol) and every rank runs it in one forward call
   (tprt.engine.runner.ModelRunner); meanwhile constrained rows' masks are computed where a
   core is spare.
3. process outputs (tprt.engine.outputs): tokens chosen at every position at once, drafts
   verified (a drafted token is kept iff the sampler picks it there: the output is the same as
   without drafts, greedy or seeded), events emitted, what a row did not keep given back.

The KV cache is paged (tprt.model.kv_cache): a pool of `kv_cache_tokens` positions in blocks of
`kv_block_size`; each sequence holds the blocks its tokens fill, and prompts share the blocks of
common prefixes (`prefix_cache`, on by default); Usage reports the prompt tokens reused.

Sampling: rank 0 samples and the ids reach the other ranks inside the next batch, so no extra
collective is needed and no rank needs the tokenizer or an RNG in step with rank 0. Every sampled
request has its own generator, seeded from `SamplingParams.seed` or else from the engine's base
seed (`EngineConfig.seed`, random when unset): a seeded request gives the same tokens whatever
else is in the batch. Greedy batches without logprobs exchange only each rank's best (value, id)
per token instead of gathering the full-vocabulary logits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tprt.distributed.protocol import Tag, post_step, send_signal, send_step, wait_sent
from tprt.engine.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SEQ_LEN, EngineConfig, context_length, kv_pool_blocks
from tprt.engine.constraints import StructuredOutputs
from tprt.engine.outputs import OutputProcessor
from tprt.engine.registry import RequestRegistry
from tprt.distributed.pipeline_mesh import PipelineMesh
from tprt.engine.runner import ModelRunner, free_memory_tokens
from tprt.engine.stage_runner import Launched, StageRunner
from tprt.engine.sampling import SamplingParams
from tprt.engine.prefix_cache import KVEvent
from tprt.engine.scheduler import KVStats, Schedule, Scheduler, SchedulerConfig, Status
from tprt.engine.sequence import Sequence, TokenEvent, Usage
from tprt.engine.speculative import SpecStats, SpeculativeDecoder, build_speculator
from tprt.engine.structured import RowMasks, StructuredOutputManager
from tprt.model.llama import TPLlamaForCausalLM
from tprt.model.stage import TPLlamaStage
from tprt.text.tokenizer import Tokenizer

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_SEQ_LEN", "Completion", "Engine", "EngineConfig", "KVStats",
           "kv_pool_blocks", "run_to_completion"]


class Engine:
    """Continuous-batching generation over one rank's model shard: rank 0 schedules each step,
    every rank runs it, rank 0 chooses the tokens (see the module docstring)."""

    def __init__(self, model: TPLlamaForCausalLM, tokenizer: Tokenizer | None = None,
                 config: EngineConfig = EngineConfig(), eos_token_ids: Seq[int] | None = None,
                 pipeline: PipelineMesh | None = None) -> None:
        """`pipeline`: `model` is this rank's stage (tprt.model.stage) of a pipeline on this
        mesh; steps and commands then go to every rank of the pipeline (tprt.engine.stage_runner)."""
        # The group rank 0 sends steps and commands to: the TP group, or the whole pipeline.
        self.tp = model.tp if pipeline is None or pipeline.stages == 1 else pipeline.replica()
        self.config, self.tokenizer = config, tokenizer
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = context_length(config, model.config.max_position_embeddings)
        n_blocks = kv_pool_blocks(config, self.max_seq_len, free_memory_tokens(model, config, self.tp))
        windows = set(model.config.windows)  # one window on every layer (Mistral): blocks behind it are freed
        self.scheduler: Scheduler[Sequence] = Scheduler(SchedulerConfig(
            config.max_batch, config.token_budget, n_blocks, config.kv_block_size, config.prefix_cache,
            windows.pop() if len(windows) == 1 else None))
        if pipeline is not None and pipeline.stages > 1:
            assert isinstance(model, TPLlamaStage), "a pipeline's rank serves its stage"
            self.runner: ModelRunner = StageRunner(model, pipeline, n_blocks, config.kv_block_size, config.max_batch,
                                                   self.max_seq_len, config.runner(), config.pipeline_microbatches)
        else:
            self.runner = ModelRunner(model, n_blocks, config.kv_block_size, config.max_batch, self.max_seq_len,
                                      config.runner())
        self.eos_token_ids = tuple((tokenizer or model.config).eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.structured = StructuredOutputManager(tokenizer, self.vocab_size, self.eos_token_ids, config.mask_threads)
        self.speculative = None if config.speculative is None or not self.is_driver else SpeculativeDecoder(
            build_speculator(config.speculative, self.vocab_size, config.max_batch, self.max_seq_len),
            self.tp.device.type, self.structured.grammar_prefix)
        self.outputs = OutputProcessor(self.scheduler, self.structured, self.speculative, self._end)
        self.requests = RequestRegistry(tokenizer, self.eos_token_ids, self.vocab_size, self.max_seq_len,
                                        self.tp.device, config.seed, self.structured)
        self._closed = False
        self._forward_s = 0.0  # decayed average of a step's forward pass (the mask throttle's yardstick)
        # Over pipeline stages, steps launched and not yet collected (oldest first): one per stage
        # keeps every stage busy (see `_pipelined_step`); speculative decoding drafts from each
        # row's newest token, so it keeps one.
        self.steps_in_flight = 1
        if isinstance(self.runner, StageRunner) and self.speculative is None:
            self.steps_in_flight = config.pipeline_steps_in_flight or self.runner.mesh.stages
        self._in_flight: deque[_InFlight] = deque()

    @property
    def is_driver(self) -> bool:
        """True on TP rank 0 (of the first stage), which schedules, samples and reports; the
        others `follow()`."""
        return self.tp.rank == 0

    @property
    def has_work(self) -> bool:
        return bool(len(self.requests) or self.requests.pending or self._in_flight)

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def unfinished_at(self, priority: int) -> int:
        """Unfinished requests of one priority."""
        return self.requests.count(priority)

    @property
    def kv_stats(self) -> KVStats:
        return self.scheduler.kv_stats()

    def record_kv_events(self) -> None:
        """From now on the KV block pool records the blocks it names and evicts (`take_kv_events`)."""
        self.scheduler.pool.events = []

    def take_kv_events(self) -> list[KVEvent]:
        """What the block pool recorded since the last call (nothing unless recording)."""
        pool = self.scheduler.pool
        if not pool.events:
            return []
        events, pool.events = pool.events, []
        return events

    @property
    def kv_block_size(self) -> int:
        return self.scheduler.pool.block_size

    @property
    def structured_outputs(self) -> StructuredOutputs:
        """Compiles output constraints for this engine's tokenizer (thread-safe; settable)."""
        return self.structured.outputs

    @structured_outputs.setter
    def structured_outputs(self, outputs: StructuredOutputs) -> None:
        self.structured.outputs = outputs

    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding's counts since start (None when it is off): for metrics."""
        return self.speculative.stats if self.speculative is not None else None

    def add(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str, adapter: int = 0,
            priority: int = 0) -> None:
        """Queues a request; it joins the batch at a coming step. `adapter`: the index its rows are
        routed to (tprt.lora.routing.AdapterSlots; 0 = the base model); `priority`: 0 interactive,
        higher background (tprt.engine.scheduler). Raises ValidationError naming the field, through
        the front ends' checks (tprt.engine.request)."""
        self._require_driver()
        self.scheduler.add(self.requests.new(prompt_ids, params, request_id, adapter, priority))

    def propose(self, request_id: str, draft: Seq[int]) -> int:
        """Drafted tokens for the positions after a running request's last token, verified in its
        next row (replacing an unverified one), trimmed to what it may still generate and what its
        grammar accepts. Returns how many were taken (none unless it is decoding)."""
        self._require_driver()
        return self.requests.propose(request_id, draft)

    def forget_prefixes(self, adapter: int) -> None:
        """Adapter index `adapter` has new weights (reloaded, or dropped from the pool): keys and
        values computed with the old ones are never reused, nor its outputs for suffix drafting."""
        self.requests.new_version(adapter)
        if self.speculative is not None:
            self.speculative.forget(adapter)

    def cancel(self, request_id: str) -> bool:
        """Ends a request now and frees its blocks; the next step reports it as "cancelled".
        False when the request is unknown or already finished."""
        self._require_driver()
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._end(seq, False)
        self.requests.pending.append(TokenEvent(request_id, None, "", finish_reason="cancelled", usage=seq.usage()))
        return True

    def step(self) -> list[TokenEvent]:
        """Schedules one step, has every rank execute it, chooses its tokens; returns its events.
        Collective over the TP group when there is model work (every follower in `follow()`)."""
        self._require_driver()
        if self.steps_in_flight > 1:
            return self._pipelined_step()
        events, self.requests.pending = self.requests.pending, []
        running = [s for s in self.scheduler.running if s.status is Status.RUNNING]
        if self.speculative is not None:
            self.speculative.propose(running)
        self.structured.throttle(running, self._forward_s)
        schedule = self.scheduler.schedule()
        if schedule.batch is None:
            return events
        send_step(schedule.batch, self.tp)
        constrained = [(s, list(s.draft[: n - 1])) for s, n in zip(schedule.decode, schedule.batch.lens)
                       if s.matcher is not None]
        constrained += [(s, []) for s, n in schedule.prefill if schedule.ends_prompt(s, n) and s.matcher is not None]
        masks = self.structured.start(constrained) if constrained else None
        with self.runner.threads_for(schedule.batch):  # the one-row steps' thread count, for sampling too
            started = time.perf_counter()
            result = self.runner.execute(schedule.batch)
            seconds = time.perf_counter() - started
            self._forward_s = seconds if not self._forward_s else 0.8 * self._forward_s + 0.2 * seconds
            if self.speculative is not None:
                self.speculative.observe_step(schedule.batch.num_tokens, not schedule.prefill, seconds)
            return events + self.outputs.process(schedule, result, masks.result() if masks is not None else {})

    def _pipelined_step(self) -> list[TokenEvent]:
        """`step` over pipeline stages with up to `steps_in_flight` steps launched: a new step
        takes the rows not in flight (the others sit out, never preempted) and goes to the
        stages without waiting for them; the oldest step is collected (its tokens chosen, its
        events returned) once the pipeline is full or nothing new can start. Each stage works on
        a different step, and a row's tokens are still those of one step at a time."""
        events, self.requests.pending = self.requests.pending, []
        launched = False
        if len(self._in_flight) < self.steps_in_flight:
            running = [s for s in self.scheduler.running if s.status is Status.RUNNING and not s.in_flight]
            self.structured.throttle(running, self._forward_s)
            schedule = self.scheduler.schedule()
            if schedule.batch is not None:
                launched = True
                self._in_flight.append(self._launch(schedule))
        if self._in_flight and (len(self._in_flight) >= self.steps_in_flight or not launched):
            events += self._collect(self._in_flight.popleft())
        return events

    def _launch(self, schedule: Schedule[Sequence]) -> _InFlight:
        assert schedule.batch is not None and isinstance(self.runner, StageRunner)
        sends = post_step(schedule.batch, self.tp)
        constrained = [(s, list(s.draft[: n - 1])) for s, n in zip(schedule.decode, schedule.batch.lens)
                       if s.matcher is not None]
        constrained += [(s, []) for s, n in schedule.prefill if schedule.ends_prompt(s, n) and s.matcher is not None]
        masks = self.structured.start(constrained) if constrained else None
        rows = [*schedule.decode, *(s for s, _ in schedule.prefill)]
        for seq in rows:
            seq.in_flight = True
        started = time.perf_counter()
        launched = self.runner.launch(schedule.batch)
        return _InFlight(schedule, masks, launched, rows, sends, started)

    def _collect(self, step: _InFlight) -> list[TokenEvent]:
        assert isinstance(self.runner, StageRunner)
        result = self.runner.collect(step.launched)
        wait_sent(step.sends)
        seconds = (time.perf_counter() - step.started) / self.steps_in_flight  # a stage's share
        self._forward_s = seconds if not self._forward_s else 0.8 * self._forward_s + 0.2 * seconds
        for seq in step.rows:
            seq.in_flight = False
        return self.outputs.process(step.schedule, result, step.masks.result() if step.masks is not None else {})

    def follow(self) -> Tag:
        """On ranks other than 0: executes rank 0's batches (and waits through its keepalives)
        until it sends anything else; returns that message's tag: EXIT after `close()`, or
        COMMAND (tprt.distributed.ranks.follower_loop receives and runs the command)."""
        if self.is_driver:
            raise RuntimeError("Engine.follow() is for TP ranks other than 0")
        return self.runner.follow(self.tp)

    def close(self) -> None:
        """Rank 0: releases the followers, whose `follow()` returns EXIT (collective; once, idempotent)."""
        if self.is_driver and not self._closed:
            while self._in_flight:  # every launched step collected before the followers leave
                self._collect(self._in_flight.popleft())
            send_signal(Tag.EXIT, self.tp)
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_driver(self) -> None:
        if not self.is_driver:
            raise RuntimeError("requests and steps are driven from TP rank 0; other ranks call follow()")
        if self._closed:
            raise RuntimeError("the engine is closed")

    def _end(self, seq: Sequence, completed: bool) -> None:
        self.scheduler.remove(seq)
        self.requests.remove(seq)
        if self.speculative is not None:
            self.speculative.finish(seq, completed)


@dataclass
class _InFlight:
    """A step launched over pipeline stages and not yet collected."""

    schedule: Schedule[Sequence]
    masks: Future[dict[str, RowMasks]] | None
    launched: Launched
    rows: list[Sequence]
    sends: list[tuple[Any, Any]]
    started: float


@dataclass
class Completion:
    """A finished request, assembled from its events."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None

    def add(self, event: TokenEvent) -> None:
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            if event.logprob is not None:
                self.logprobs.append(event.logprob)
                self.top_logprobs.append(list(event.top_logprobs))
        self.text += event.text
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.usage = event.finish_reason, event.stop_reason, event.usage


def run_to_completion(engine: Engine, on_event: Callable[[TokenEvent], None] | None = None) -> dict[str, Completion]:
    """Steps the engine (rank 0) until every request has finished; returns each one's Completion.
    `on_event`, when given, sees every event as it is produced (e.g. to stream text)."""
    done: dict[str, Completion] = {}
    while engine.has_work:
        for event in engine.step():
            done.setdefault(event.request_id, Completion(event.request_id)).add(event)
            if on_event is not None:
                on_event(event)
    return done
