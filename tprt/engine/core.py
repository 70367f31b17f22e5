"""The generation engine: a set of live sequences of different lengths, advanced one step at a time.

API (rank 0 drives, every other TP rank follows):

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
        engine.follow()                         # executes rank 0's plans until close() (or a command)

The engine is a scheduler and a driver. *What to do* in a step is decided on rank 0 by the
scheduler (tprt.engine.scheduler: admission, token budget, KV blocks, preemption, prefix sharing;
plain data, no tensors) and written down as a `tprt.engine.plan.StepPlan`: a prefill batch of
uneven prompt chunks and a decode batch of one row per running sequence, each row with its KV
block table and its new tokens (one, or the last token and a draft). The driver, `Engine` here,
sends the plan to the other ranks as a STEP message of the rank protocol
(tprt.distributed.protocol), runs it (`tprt.engine.runner.ModelRunner.execute`, identical on
every rank), samples, and turns the result into TokenEvents.

The KV cache is paged (tprt.model.kv_cache): a pool of `kv_cache_tokens` positions in blocks of
`kv_block_size`; each sequence holds the blocks its tokens fill, so memory follows the tokens in
use rather than max_batch x max_seq_len. Prefix sharing (`EngineConfig.prefix_cache`, on by
default; tprt.engine.prefix_cache) lets a prompt point at the blocks of a common prefix computed
before; Usage reports how many prompt tokens were reused.

Rows carry k tokens: `propose(request_id, draft)` gives a running request tokens for the
positions after its last one; its next decode row computes them all and returns logits for
each. Speculative decoding (`EngineConfig.speculative`, tprt.engine.speculative) drafts them
itself before each step. Each drafted token is kept iff the sampler, at the position before it,
picks it (tprt.engine.sampling.sample): a greedy row's argmax, a sampled row's draw, which picks
a deterministic draft with probability p(token), the speculative rejection rule's acceptance.
The first token not kept ends the row, and the rest of its positions are given back to the
scheduler. Output is the same as without drafts, token for token, greedy or seeded.
A constrained row's draft is cut to what its grammar accepts, and it gets a mask per position.

Sampling: rank 0 samples and the ids reach the other ranks inside the next plan (the decode
batch's input tokens), so no extra collective is needed and no rank needs the tokenizer or an
RNG in step with rank 0. (The alternative, identically seeded generators on every rank, would
need bit-identical logits and request state everywhere.) Every sampled request has its own
generator, seeded from `SamplingParams.seed` or else from the engine's base seed
(`EngineConfig.seed`, random when unset): a seeded request gives the same tokens whatever else is
in the batch. Greedy batches without logprobs exchange only each rank's best (value, id) per
row instead of gathering the full-vocabulary logits.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tprt.errors import ConfigError, ValidationError
from tprt.model.llama import TPLlamaForCausalLM
from tprt.distributed.protocol import Tag, receive_header, receive_step, send_signal, send_step
from tprt.engine.constraints import StructuredOutputs, bits_to_bool
from tprt.engine.plan import BatchPlan, StepPlan
from tprt.engine.request import check_request
from tprt.engine.runner import BatchResult, ModelRunner, free_memory_tokens
from tprt.engine.sampling import SamplingParams, sample
from tprt.engine.scheduler import Scheduler, SchedulerConfig, Status
from tprt.engine.speculative import SpecStats, SpeculativeConfig, Speculator, build_speculator
from tprt.engine.sequence import Sequence, TokenEvent, Usage
from tprt.text.tokenizer import Tokenizer

DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_BLOCK_SIZE = 16
MAX_MASK_THREADS = 8  # constrained rows' masks computed at once, at most
MIN_MASK_SHARE_S = 0.002  # what constrained rows' masks may add to a step in all, at least (Engine._throttle_masks)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences admitted at once (prefilling or decoding)
    max_seq_len: int | None = None  # tokens per sequence (prompt + output); None: min(model's, 2048)
    token_budget: int = 2048  # tokens per step: every decode row's tokens plus prefill chunks
    seed: int | None = None  # base seed for sampled requests without their own seed
    cache_dtype: torch.dtype | None = None  # KV cache storage (int8, float8_e4m3fn: quantized); None: the model's
    # An int8 cache's static scales, model-wide [layers, 2, kv heads] (tprt.model.kv_scales); None:
    # a scale per head vector.
    kv_scales: torch.Tensor | None = None
    cpu_prepack: bool = True  # CPU bf16 weights: repack for oneDNN (faster decode, 2x weight memory)
    static_decode: bool | None = None  # static-shape decode (CUDA graphs on GPU); None: on CUDA only
    # CPU: torch threads for steps that only decode one row (None: leave the thread count alone).
    # The one-row kernels run on their own thread pool (tprt.cpu.native.set_threads), and torch's
    # threads would only add OpenMP fork/joins to the few small ops left (docs/PERF.md). Other
    # steps use the caller's thread count.
    one_row_threads: int | None = 1
    # Share the KV blocks of common prompt prefixes (see the module docstring).
    prefix_cache: bool = True
    kv_cache_tokens: int | None = None  # KV positions in the pool; None: see gpu_memory_fraction
    kv_block_size: int = DEFAULT_BLOCK_SIZE  # positions per KV block
    # CUDA, without kv_cache_tokens: the pool takes this share of the device memory free after the
    # weights (the smallest over the TP ranks). Otherwise (and off CUDA) the pool holds
    # max_batch x max_seq_len positions, as many as one slot per sequence would.
    gpu_memory_fraction: float | None = None
    # Speculative decoding (tprt.engine.speculative): rank 0 drafts tokens for decoding rows and
    # verifies them in one step; None: off.
    speculative: SpeculativeConfig | None = None
    # Constrained rows: compute their masks on a thread while the forward pass runs (True), or
    # after it and only where a row needs one (False); None: overlap when a CPU core is spare.
    overlap_masks: bool | None = None


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


class EngineLike(Protocol):
    """What rank 0's engine loop (serve/core/loop.py) uses of an `Engine`: a fake one can drive it."""

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

    def add(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str, adapter: int = 0) -> None: ...

    def cancel(self, request_id: str) -> bool: ...

    def step(self) -> list[TokenEvent]: ...


@dataclass(frozen=True)
class _Choice:
    """The token chosen at one position of a row, with what its event reports."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


class Engine:
    """Continuous-batching generation over one rank's model shard: rank 0's scheduler plans each
    step, every rank runs it, rank 0 samples (see the module docstring)."""

    def __init__(self, model: TPLlamaForCausalLM, tokenizer: Tokenizer | None = None,
                 config: EngineConfig = EngineConfig(), eos_token_ids: Seq[int] | None = None) -> None:
        self.config = config
        self.tp = model.tp
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = _context(config, model.config.max_position_embeddings)
        free = None if config.kv_cache_tokens is not None else free_memory_tokens(model, config.gpu_memory_fraction,
                                                                                 config.cache_dtype,
                                                                                 config.kv_scales is not None)
        n_blocks = kv_pool_blocks(config, self.max_seq_len, free)
        self.scheduler: Scheduler[Sequence] = Scheduler(SchedulerConfig(
            config.max_batch, config.token_budget, n_blocks, config.kv_block_size, config.prefix_cache))
        self.runner = ModelRunner(model, n_blocks, config.kv_block_size, config.max_batch, self.max_seq_len,
                                  config.cache_dtype, config.cpu_prepack, config.static_decode,
                                  config.one_row_threads, config.kv_scales)
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else model.config.eos_token_ids
        self.eos_token_ids = tuple(eos_token_ids)
        self._seeds = random.Random(config.seed)
        self._by_id: dict[str, Sequence] = {}
        self._adapter_versions: dict[int, int] = {}
        self._pending: list[TokenEvent] = []  # cancellations, reported by the next step
        self._closed = False
        self._structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()
        self._masker: MaskWorker | None = None
        self._forward_s = 0.0  # decayed average of a step's forward pass (the mask throttle's yardstick)
        self._speculator: Speculator | None = None
        if config.speculative is not None and self.is_driver:
            self._speculator = build_speculator(config.speculative, self.vocab_size, config.max_batch,
                                                self.max_seq_len)

    # ----------------------------------------------------------------- requests (rank 0)

    @property
    def is_driver(self) -> bool:
        """True on TP rank 0, which schedules, samples and reports; the others `follow()`."""
        return self.tp.rank == 0

    @property
    def has_work(self) -> bool:
        return bool(self._by_id or self._pending)

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (blocks freed, recomputed later)."""
        return self.scheduler.preemptions

    @property
    def kv_capacity(self) -> int:
        """KV cache positions in all (the pool's blocks, scratch excluded)."""
        pool = self.scheduler.pool
        return pool.capacity * pool.block_size

    @property
    def kv_tokens(self) -> int:
        """KV cache positions in blocks held by live sequences (a shared block counts once)."""
        pool = self.scheduler.pool
        return pool.used * pool.block_size

    @property
    def kv_blocks(self) -> tuple[int, int, int]:
        """(blocks held by live sequences, blocks cached for prefix reuse, blocks in all)."""
        pool = self.scheduler.pool
        return pool.used, pool.cached, pool.capacity

    @property
    def kv_stats(self) -> KVStats:
        s = self.scheduler
        return KVStats(s.pool.block_size, *self.kv_blocks, s.prefix_queried_tokens, s.prefix_hit_tokens,
                       s.preemptions)

    def add(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str, adapter: int = 0) -> None:
        """Queues a request; it joins the batch at a coming step. `adapter`: the index its rows are
        routed to (`tprt.lora.routing.AdapterSlots`; 0 = the base model). Raises ValidationError naming the
        field (prompt, max_new_tokens, stop_strings, request_id or a sampling field), through the
        same checks as the front ends' `tprt.engine.request.resolve_sampling`."""
        self._require_driver()
        prompt = self._check_request(prompt_ids, params, request_id)
        seed = None if params.greedy else (params.seed if params.seed is not None else self._seeds.getrandbits(63))
        seq = Sequence(request_id, prompt, params, seed, self.tokenizer, self.eos_token_ids, self.tp.device, adapter)
        seq.cache_key = (adapter, self._adapter_versions.get(adapter, 0))
        if params.constraint is not None:
            outputs = self.structured_outputs
            seq.matcher = outputs.matcher(outputs.compile(params.constraint))
        self._by_id[request_id] = seq
        self.scheduler.add(seq)

    @property
    def structured_outputs(self) -> StructuredOutputs:
        """Compiles output constraints for this engine's tokenizer (built at first use; thread-safe,
        so a front end can compile, and so check, a request's constraint on its own thread: `add`
        then finds it in the cache)."""
        with self._structured_lock:
            if self._structured is None:
                if self.tokenizer is None:
                    raise ValidationError("constraint", "output constraints need the model's tokenizer, "
                                                        "which it does not have")
                self._structured = StructuredOutputs(self.tokenizer)
            return self._structured

    @structured_outputs.setter
    def structured_outputs(self, outputs: StructuredOutputs) -> None:
        """Uses `outputs` (e.g. one whose compile and mask times feed a server's metrics)."""
        with self._structured_lock:
            self._structured = outputs


    def propose(self, request_id: str, draft: Seq[int]) -> int:
        """Drafted tokens for the positions after a request's last token: its next decode row
        carries them, and each is kept iff the sampler picks it at its position (see the module
        docstring). Replaces an earlier draft not yet verified; trimmed to the tokens the request
        may still generate, and for a constrained request to the tokens its grammar accepts.
        Returns how many were taken: none while the request is not decoding (waiting, or
        prefilling again after a preemption, which also drops its draft). Raises ValidationError
        naming request_id (unknown or finished) or draft."""
        self._require_driver()
        seq = self._by_id.get(request_id)
        if seq is None:
            raise ValidationError("request_id", f"request_id {request_id!r} is not a running request")
        ids = [int(t) for t in draft]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValidationError("draft", f"draft token ids must be in [0, {self.vocab_size - 1}]")
        room = seq.params.max_new_tokens - len(seq.output) - 1
        seq.draft = self._grammar_prefix(seq, ids[: max(0, room)]) if seq.status is Status.RUNNING else []
        return len(seq.draft)

    @staticmethod
    def _grammar_prefix(seq: Sequence, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` that seq's output constraint accepts (all without one)."""
        if seq.matcher is None or not draft:
            return draft
        n = seq.matcher.accept_prefix(draft)
        seq.matcher.rollback(n)
        return draft[:n]

    def _speculate(self) -> None:
        """Drafts for the decoding requests that have none (rank 0's speculator, when configured)."""
        spec = self._speculator
        if spec is None:
            return
        decoding = sum(s.status is Status.RUNNING for s in self.scheduler.running)
        # Every row of a decode batch is padded to the widest: draft only while rows x (1 + k) is
        # a step about as cheap as one of single tokens (SpeculativeConfig.max_step_tokens).
        widest = spec.config.step_tokens(self.tp.device.type) // max(decoding, 1) - 1
        seqs = [s for s in self.scheduler.running
                if s.status is Status.RUNNING and not s.draft and s.params.speculate is not False]
        if not seqs or widest < 1:
            return
        room = [min(widest, s.params.max_new_tokens - len(s.output) - 1) for s in seqs]
        for seq, draft in zip(seqs, spec.propose(seqs, room, rows=decoding)):
            seq.draft = self._grammar_prefix(seq, draft)

    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding's counts since start (None when it is off): for metrics."""
        return self._speculator.stats.copy() if self._speculator is not None else None

    def forget_prefixes(self, adapter: int) -> None:
        """The weights of adapter index `adapter` changed (an adapter reloaded under its index, or
        dropped from the pool): keys and values computed with the old ones are never reused, nor
        its outputs for suffix drafting."""
        self._adapter_versions[adapter] = self._adapter_versions.get(adapter, 0) + 1
        if self._speculator is not None:
            self._speculator.forget(adapter)

    def _check_request(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str) -> list[int]:
        """The prompt as ints; the request checked by the front ends' own resolver (defensive)."""
        if request_id in self._by_id:
            raise ValidationError("request_id", f"request_id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_ids]
        check_request(params, len(prompt), self.max_seq_len, self.vocab_size, what="max_seq_len",
                      has_tokenizer=self.tokenizer is not None)
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValidationError("prompt", f"prompt token ids must be in [0, {self.vocab_size - 1}]")
        return prompt

    def cancel(self, request_id: str) -> bool:
        """Ends a request now and frees its blocks; the next step reports it as "cancelled".
        False when the request is unknown or already finished."""
        self._require_driver()
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        self._end(seq)
        self._pending.append(TokenEvent(request_id, None, "", finish_reason="cancelled", usage=seq.usage()))
        return True

    # ----------------------------------------------------------------- stepping

    def step(self) -> list[TokenEvent]:
        """Plans one step, has every rank execute it, samples; returns this step's events.

        Collective over the TP group when there is model work (every follower must be in
        `follow()`); a step with nothing to run only returns pending cancellations."""
        self._require_driver()
        events, self._pending = self._pending, []
        self._speculate()
        self._throttle_masks()
        schedule = self.scheduler.schedule()
        plan = schedule.plan
        if plan.empty:
            return events
        send_step(plan, self.tp)
        # Constrained rows' masks depend only on the output so far (and a row's draft, one mask per
        # position it verifies): computed while the model runs.
        constrained: list[tuple[Sequence, list[int]]] = [(s, []) for s, n in schedule.prefill
                       if s.num_computed + n == s.prefill_target and s.matcher is not None]
        if plan.decode is not None:
            constrained += [(s, list(t[1:])) for s, t in zip(schedule.decode, plan.decode.tokens)
                            if s.matcher is not None]
        masks = None
        if constrained:
            spare = self._spare_cores()
            masks = self._mask_worker().start(constrained, spare > 0, spare)
        # A one-row step samples on the runner's thread count too: its torch ops are small, and
        # more OpenMP threads would only contend with the native kernels' spinning pool.
        with self.runner.threads_for(plan):
            started = time.perf_counter()
            result = self.runner.execute(plan)
            forward_s = time.perf_counter() - started
            self._step_cost(plan, forward_s)
            self._forward_s = forward_s if not self._forward_s else 0.8 * self._forward_s + 0.2 * forward_s
            allowed = masks.result() if masks is not None else {}
            if plan.prefill is not None and result.prefill is not None:
                done = [(i, seq) for i, (seq, n) in enumerate(schedule.prefill) if self.scheduler.prefilled(seq, n)]
                if done:  # rows that finished their prompt get a first token from their last position
                    choices = self._choose([s for _, s in done], [i for i, _ in done], result.prefill, allowed)
                    events += [self._emit(seq, c) for (_, seq), c in zip(done, choices)]
            if plan.decode is not None and result.decode is not None:
                events += self._verify(schedule.decode, plan.decode, result.decode, allowed)
        return events

    def _throttle_masks(self) -> None:
        """Constrained decoding rows whose masks cost more than their share of a step sit steps
        out (`Sequence.held`), so that costly grammars slow themselves, not the batch: together
        the masks may add about one forward pass to a step. Each row earns its share (the average
        forward pass over the constrained rows, at least MIN_MASK_SHARE_S in all) every step, and
        decodes when its savings cover what its last mask took. A row whose masks stay under its
        share is never held."""
        running = [s for s in self.scheduler.running if s.status is Status.RUNNING]
        rows = [(s, s.matcher.last_mask_s) for s in running if s.matcher is not None]  # only these are held
        if not rows:
            return
        share = max(MIN_MASK_SHARE_S, self._forward_s) / len(rows)
        for seq, cost in rows:
            seq.mask_credit = min(seq.mask_credit + share, max(cost, share))
            seq.held = cost > seq.mask_credit
            if not seq.held:
                seq.mask_credit -= cost
        if len(rows) == len(running) and all(s.held for s, _ in rows):  # someone decodes every step:
            first, _ = max(rows, key=lambda r: r[0].mask_credit / max(r[1], 1e-9))  # the row closest to its turn
            first.held = False
            first.mask_credit = 0.0

    def _spare_cores(self) -> int:
        """How many threads beside the forward pass have a core of their own (for constrained
        rows' masks, computed in parallel): on a GPU the host's cores (up to MAX_MASK_THREADS);
        on the CPU those the kernels of all this host's ranks (LOCAL_WORLD_SIZE, as torchrun and
        tprt's launcher set it) leave. `overlap_masks` False: none; True: at least one."""
        if self.config.overlap_masks is False:
            return 0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if self.tp.device.type != "cpu":
            spare = cores
        else:
            from tprt.cpu import native

            local = os.environ.get("LOCAL_WORLD_SIZE", "1")
            local_ranks = max(1, int(local)) if local.isdigit() else 1
            spare = cores - max(torch.get_num_threads(), native.threads()) * local_ranks
        spare = min(max(spare, 0), MAX_MASK_THREADS)
        return max(spare, 1) if self.config.overlap_masks else spare

    def _step_cost(self, plan: StepPlan, seconds: float) -> None:
        """A decode-only step's time, for the speculator's pricing of drafts: steps as wide as it
        may draft (wider ones take other kernels, whose cost says nothing about drafting)."""
        spec = self._speculator
        if spec is None or plan.prefill is not None or plan.decode is None:
            return
        tokens = plan.decode.rows * plan.decode.width
        if tokens <= spec.config.step_tokens(self.tp.device.type):
            spec.costs.observe(tokens, seconds)

    def _mask_worker(self) -> MaskWorker:
        if self._masker is None:
            self._masker = MaskWorker(self.structured_outputs, self.vocab_size, self.eos_token_ids)
        return self._masker

    def follow(self) -> Tag:
        """On ranks other than 0: executes rank 0's plans (and waits through its keepalives) until
        it sends anything else; returns that message's tag: EXIT after `close()`, or COMMAND
        (tprt.distributed.ranks.follower_loop receives and runs the command)."""
        if self.is_driver:
            raise RuntimeError("Engine.follow() is for TP ranks other than 0")
        while True:
            header = receive_header(self.tp)
            if header.tag is Tag.STEP:
                self.runner.execute(StepPlan.decode_from(receive_step(header, self.tp)))
            elif header.tag is not Tag.KEEPALIVE:
                return header.tag

    def close(self) -> None:
        """Rank 0: releases the followers, whose `follow()` returns EXIT (collective; once, idempotent)."""
        if self.is_driver and not self._closed:
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

    # ----------------------------------------------------------------- sampling and events

    def _verify(self, seqs: list[Sequence], batch: BatchPlan, result: BatchResult,
                allowed: dict[str, RowMasks]) -> list[TokenEvent]:
        """Chooses each decode row's tokens position by position: at a position with a drafted
        token after it, the draft is kept iff the sampler picks it there (tprt.engine.sampling's
        coupled rule); a row goes on while its drafts are kept and ends at the first one
        replaced (or its end, or the request's); the positions after what it kept are given
        back. Result rows: each decode row's positions in order."""
        firsts = [0]
        for tokens in batch.tokens:
            firsts.append(firsts[-1] + len(tokens))
        live = list(range(len(seqs)))  # rows still choosing
        kept = [0] * len(seqs)
        accepted = [0] * len(seqs)
        events: list[TokenEvent] = []
        j = 0
        while live:
            drafts = [batch.tokens[r][j + 1] if j + 1 < len(batch.tokens[r]) else -1 for r in live]
            choices = self._choose([seqs[r] for r in live], [firsts[r] + j for r in live], result, allowed, j)
            still = []
            for r, choice, draft in zip(live, choices, drafts):
                seq = seqs[r]
                events.append(self._emit(seq, choice))
                kept[r] += 1
                hit = draft >= 0 and choice.token_id == draft
                accepted[r] += hit
                if seq.status is not Status.FINISHED and hit:
                    still.append(r)
                    continue
                if seq.status is not Status.FINISHED:
                    self.scheduler.decoded(seq, kept[r])
                if self._speculator is not None:
                    self._speculator.observe(seq, len(batch.tokens[r]) - 1, accepted[r], kept[r])
            live, j = still, j + 1
        return events

    def _choose(self, seqs: list[Sequence], rows: list[int], result: BatchResult,
                allowed: dict[str, RowMasks], position: int = 0) -> list[_Choice]:
        """The next token of each sequence from its result row (constrained ones among the tokens
        `allowed[request_id]` allows at `position`)."""
        if result.logits is None:  # greedy rows: the argmax, which keeps a draft iff it is the draft
            assert result.ids is not None
            ids = result.ids.tolist()
            return [_Choice(ids[r], None, []) for r in rows]
        all_rows = rows == list(range(result.logits.shape[0]))
        logits = result.logits if all_rows else result.logits[torch.tensor(rows, device=result.logits.device)]
        here = any(s.request_id in allowed and position < allowed[s.request_id].positions for s in seqs)
        mask = None
        if here and self._masker is not None:
            best = logits.argmax(dim=-1).tolist()
            mask = self._masker.rows(seqs, allowed, best, position)
            if mask is None and all(_plain_greedy(s.params) for s in seqs):  # every row takes its argmax
                return [_Choice(t, None, []) for t in best]  # (which keeps a greedy row's draft iff it is the draft)
            mask = None if mask is None else mask.to(logits.device)
        chosen = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], [s.history() for s in seqs],
                        mask)
        ids, logprobs = chosen.token_ids.tolist(), chosen.logprobs.tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in seqs]
        if chosen.top_ids.shape[1]:
            top_ids, top_lps = chosen.top_ids.tolist(), chosen.top_logprobs.tolist()
            tops = [list(zip(top_ids[i], top_lps[i])) for i in range(len(seqs))]
        return [_Choice(ids[i], logprobs[i], tops[i]) for i in range(len(seqs))]

    def _emit(self, seq: Sequence, choice: _Choice) -> TokenEvent:
        """Appends a chosen token to its sequence; its event (the last one when it finished)."""
        out = seq.append(choice.token_id)
        p = seq.params
        finished = out.finish_reason is not None
        event = TokenEvent(
            seq.request_id, choice.token_id, out.text,
            logprob=choice.logprob if p.logprobs else None,
            top_logprobs=tuple(choice.top[: p.top_logprobs]) if p.logprobs else (),
            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            usage=seq.usage() if finished else None,
        )
        if finished:
            self._end(seq, completed=True)
        return event

    def _end(self, seq: Sequence, completed: bool = False) -> None:
        self.scheduler.remove(seq)
        self._by_id.pop(seq.request_id, None)
        if self._speculator is not None:
            self._speculator.finish(seq, completed)


class RowMasks:
    """One constrained row's next-token bitmasks for a step: position j is the token after the
    row's first j drafted tokens (all of which its grammar accepts: `Engine._grammar_prefix`).
    Either all filled ahead, on the mask worker's thread before any token of the step is chosen,
    or each computed when asked: by then the row's matcher has taken the tokens kept before that
    position, which are its drafts (`Engine._verify` goes on along a row only while its draft is
    kept). A greedy row usually needs no mask (`allows`). A position whose grammar allows nothing
    may only end: EOS."""

    def __init__(self, seq: Sequence, draft: list[int], outputs: StructuredOutputs, eos: list[int]) -> None:
        assert seq.matcher is not None
        self._matcher = seq.matcher
        self._draft = draft
        self._outputs = outputs
        self._eos = eos
        self.positions = 1 + len(draft)
        self._ahead: torch.Tensor | None = None  # [positions, words], when filled ahead

    def fill(self) -> None:
        """Computes every position's mask now, before the step's tokens are chosen."""
        words = self._outputs.bitmask(self.positions)
        consumed = 0
        for j in range(self.positions):
            self._fill(words[j])
            if j == len(self._draft) or not self._matcher.accept(self._draft[j]):
                break  # (a refused draft cannot happen: it was cut to the grammar)
            consumed += 1
        self._matcher.rollback(consumed)
        self._ahead = words

    def _fill(self, row: torch.Tensor) -> None:
        self._matcher.fill_bitmask(row)
        if self._eos and not row.any():
            row[self._eos[0] // 32] = _signed_bit(self._eos[0] % 32)

    def words(self, position: int) -> torch.Tensor:
        """The int32 bitmask row of `position`."""
        if self._ahead is not None:
            return self._ahead[position]
        row = self._outputs.bitmask(1)[0]
        self._fill(row)  # the matcher stands at `position` now
        return row

    def allows(self, position: int, token: int) -> bool:
        """Whether the grammar takes `token` at `position`: from the mask when it was filled
        ahead, else by asking the matcher about that one token (microseconds, not a whole mask)."""
        if self._ahead is not None:
            return bool(int(self._ahead[position, token // 32]) >> (token % 32) & 1)
        return self._matcher.validates([token]) == 1


class MaskWorker:
    """Constrained sequences' next-token masks, made into the rows `sample` takes only where they
    change the choice. When the forward pass leaves a CPU core free (a GPU runs it, or the CPU
    kernels use fewer threads than there are cores) the bitmasks are computed on a thread of
    their own while it runs (llguidance releases the GIL). When the kernels use every core, that
    thread would stall them (a preempted kernel thread holds up the others at each barrier), so
    masks are computed after the pass, and only for the rows that need one: a greedy row whose
    most likely token the grammar takes needs none."""

    def __init__(self, outputs: StructuredOutputs, vocab: int, eos_token_ids: Seq[int]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._outputs = outputs
        self._vocab = vocab
        self._known = min(vocab, outputs.vocab_size)  # tokens the tokenizer (and so the matcher) knows
        self._eos = [t for t in eos_token_ids if t < self._known][:1]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tprt-masks")
        # Rows' masks in parallel (llguidance releases the GIL): one slow grammar's row does not
        # hold up the others' behind it.
        self._rows_pool = ThreadPoolExecutor(min(MAX_MASK_THREADS, os.cpu_count() or 1),
                                             thread_name_prefix="tprt-mask-rows")

    def start(self, rows: list[tuple[Sequence, list[int]]], overlap: bool = True,
              threads: int = 1) -> Future[dict[str, RowMasks]]:
        """Each (sequence, draft) row's masks, one position for its next token, then one after
        each drafted token; filled while the step runs with `overlap`, `threads` rows at a time,
        else later, as `rows` needs them."""
        masks = {seq.request_id: RowMasks(seq, draft, self._outputs, self._eos) for seq, draft in rows}
        if overlap:
            return self._pool.submit(self._fill, masks, threads)
        done: Future[dict[str, RowMasks]] = Future()
        done.set_result(masks)
        return done

    def _fill(self, masks: dict[str, RowMasks], threads: int) -> dict[str, RowMasks]:
        rows = list(masks.values())
        if threads <= 1 or len(rows) <= 1:
            for row in rows:
                row.fill()
            return masks
        chunks = [rows[i::threads] for i in range(min(threads, len(rows)))]
        for done in [self._rows_pool.submit(_fill_all, chunk) for chunk in chunks]:
            done.result()
        return masks

    def rows(self, seqs: list[Sequence], masks: dict[str, RowMasks], best: list[int],
             position: int = 0) -> torch.Tensor | None:
        """[rows, vocab] bool (on the CPU) for `sample` at `position`, or None when no row needs
        one. `best`: each row's most likely token. A greedy row whose most likely token is allowed
        needs none (the mask would not change its choice); other constrained rows get their mask
        (never a token past the tokenizer's vocabulary); free rows everything."""
        constrained = [(i, masks[s.request_id]) for i, s in enumerate(seqs)
                       if s.request_id in masks and position < masks[s.request_id].positions]
        pending = []
        for i, row in constrained:
            p = seqs[i].params
            if p.greedy and p.repetition_penalty == 1.0 and best[i] < self._known and row.allows(position, best[i]):
                continue
            pending.append((i, row))
        if not pending:
            return None
        # After the pass the cores are free: several rows' masks are computed at once.
        rows = [row for _, row in pending]
        words = list(self._rows_pool.map(lambda row: row.words(position), rows)) if len(rows) > 1 \
            else [rows[0].words(position)]
        needed = [(i, w) for (i, _), w in zip(pending, words)]
        mask = torch.ones(len(seqs), self._vocab, dtype=torch.bool)
        bools = bits_to_bool(torch.stack([row for _, row in needed]), self._known)
        for k, (i, _) in enumerate(needed):
            mask[i, :self._known] = bools[k]
            mask[i, self._known:] = False
        return mask


def _fill_all(rows: list[RowMasks]) -> None:
    for row in rows:
        row.fill()


def _plain_greedy(p: SamplingParams) -> bool:
    """A row whose choice is its logits' argmax and reports nothing else."""
    return p.greedy and p.repetition_penalty == 1.0 and not p.logprobs


def _signed_bit(bit: int) -> int:
    """The int32 value with only `bit` set (bit 31 is the sign)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


def kv_pool_blocks(config: EngineConfig, max_seq_len: int, free_memory_tokens: int | None = None) -> int:
    """Blocks in the KV pool (scratch included): enough for kv_cache_tokens (else for
    `free_memory_tokens`, else for max_batch x max_seq_len), which must hold one sequence of
    max_seq_len (so the oldest admitted sequence can always finish)."""
    if config.kv_block_size < 1:
        raise ConfigError(f"kv_block_size must be at least 1, got {config.kv_block_size}")
    tokens = config.kv_cache_tokens or free_memory_tokens or config.max_batch * max_seq_len
    if tokens < max_seq_len:
        raise ConfigError(f"kv_cache_tokens={tokens} cannot hold one sequence of max_seq_len={max_seq_len}")
    return -(-tokens // config.kv_block_size) + 1


def _context(config: EngineConfig, model_max: int) -> int:
    """Tokens per sequence: the config's, within the model's max_position_embeddings."""
    if config.one_row_threads is not None and config.one_row_threads < 1:
        raise ConfigError(f"one_row_threads must be at least 1 or None, got {config.one_row_threads}")
    for name in ("max_batch", "token_budget"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(config, name)}")
    if config.max_seq_len is None:
        return min(model_max, DEFAULT_MAX_SEQ_LEN)
    if not 2 <= config.max_seq_len <= model_max:
        raise ConfigError(f"max_seq_len must be in [2, {model_max}] (the model's max_position_embeddings), "
                          f"got {config.max_seq_len}")
    return config.max_seq_len


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
