"""The generation engine: a set of live sequences of different lengths, advanced one step at a time.

API (rank 0 drives, every other TP rank follows):

    engine = Engine(model, tokenizer, EngineConfig(max_batch=16))
    if engine.is_driver:                        # TP rank 0
        engine.add(prompt_ids, SamplingParams(...), "req-1")   # any time between steps
        while engine.has_work:
            for event in engine.step():         # TokenEvent: id, text delta, logprobs, finish
                ...
        engine.cancel("req-1")                  # any time between steps; ends with a "cancelled" event
        engine.close()                          # releases the followers
    else:
        engine.follow()                         # executes rank 0's plans until close() (or a command)

A step has two halves. *What to do* is decided on rank 0 by the scheduler and written down as a
`tprt.engine.plan.StepPlan` (plain data: a prefill batch of uneven prompt chunks and a decode batch
of one token per running sequence, each row with its KV block table), which is sent to the other
ranks as a STEP message of the rank protocol (tprt.distributed.protocol). *Doing it* is
`tprt.engine.runner.ModelRunner.execute(plan)`, identical on every rank.

The KV cache is paged (tprt.model.kv_cache): a pool of `kv_cache_tokens` positions in blocks of
`kv_block_size`, of which each sequence holds the blocks its tokens fill, taken as it grows and
returned when it ends, so memory follows the tokens in use rather than max_batch x max_seq_len.
The scheduler admits waiting prompts in arrival order while the per-step token budget, the
`max_batch` running sequences and free blocks last (decode rows count one token each; a prompt
longer than what is left is prefilled in chunks over several steps), so sequences join and leave
at any step. When the pool runs out, the most recently admitted sequences are preempted: their
blocks are freed and they are recomputed later, so admitted work always finishes.

Prefix sharing (`EngineConfig.prefix_cache`, on by default; tprt.engine.prefix_cache): full blocks
are named by a digest chained over their tokens, their parent and the adapter key, and a new
prompt whose leading blocks match named ones (held by live sequences, or cached after they ended,
least recently used evicted first) points at them instead of computing them. Usage reports how
many prompt tokens were reused.

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

import random
import threading
from collections import deque
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
from tprt.engine.prefix_cache import BlockPool
from tprt.engine.request import check_request
from tprt.engine.runner import BatchResult, ModelRunner
from tprt.engine.sampling import SamplingParams, sample
from tprt.engine.sequence import Sequence, Status, TokenEvent, Usage
from tprt.text.tokenizer import Tokenizer

DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences admitted at once (prefilling or decoding)
    max_seq_len: int | None = None  # tokens per sequence (prompt + output); None: min(model's, 2048)
    token_budget: int = 2048  # tokens per step: one per decoding sequence plus prefill chunks
    seed: int | None = None  # base seed for sampled requests without their own seed
    cache_dtype: torch.dtype | None = None  # KV cache dtype; None: the model's
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
    """What rank 0's server scheduler (serve/scheduler.py) uses of an `Engine`: a fake one can drive it."""

    @property
    def has_work(self) -> bool: ...

    @property
    def num_unfinished(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def kv_stats(self) -> KVStats: ...

    def add(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str, adapter: int = 0) -> None: ...

    def cancel(self, request_id: str) -> bool: ...

    def step(self) -> list[TokenEvent]: ...


class Engine:
    """Continuous-batching generation over one rank's model shard (see the module docstring)."""

    def __init__(self, model: TPLlamaForCausalLM, tokenizer: Tokenizer | None = None,
                 config: EngineConfig = EngineConfig(), eos_token_ids: Seq[int] | None = None) -> None:
        self.config = config
        self.ctx = model.tp
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = _context(config, model.config.max_position_embeddings)
        n_blocks = kv_pool_blocks(config, self.max_seq_len, _free_memory_tokens(model, config))
        self.runner = ModelRunner(model, n_blocks, config.kv_block_size, config.max_batch, self.max_seq_len,
                                  config.cache_dtype, config.cpu_prepack, config.static_decode,
                                  config.one_row_threads)
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else model.config.eos_token_ids
        self.eos_token_ids = tuple(eos_token_ids)
        self._seeds = random.Random(config.seed)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # admitted (prefilling or decoding), in admission order
        self._by_id: dict[str, Sequence] = {}
        self._pool = BlockPool(n_blocks, config.kv_block_size, share=config.prefix_cache)
        self._adapter_versions: dict[int, int] = {}
        self.preemptions = 0  # sequences preempted (blocks freed, recomputed later)
        self.prefix_queried_tokens = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0  # of those, found in shared blocks
        self._pending: list[TokenEvent] = []  # cancellations, reported by the next step
        self._closed = False
        self._structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()
        self._masker: MaskWorker | None = None

    # ----------------------------------------------------------------- requests (rank 0)

    @property
    def is_driver(self) -> bool:
        """True on TP rank 0, which schedules, samples and reports; the others `follow()`."""
        return self.ctx.rank == 0

    @property
    def has_work(self) -> bool:
        return bool(self._by_id or self._pending)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    @property
    def kv_capacity(self) -> int:
        """KV cache positions in all (the pool's blocks, scratch excluded)."""
        return self._pool.capacity * self._pool.block_size

    @property
    def kv_tokens(self) -> int:
        """KV cache positions in blocks held by live sequences (a shared block counts once)."""
        return self._pool.used * self._pool.block_size

    @property
    def kv_blocks(self) -> tuple[int, int, int]:
        """(blocks held by live sequences, blocks cached for prefix reuse, blocks in all)."""
        return self._pool.used, self._pool.cached, self._pool.capacity

    @property
    def kv_stats(self) -> KVStats:
        return KVStats(self._pool.block_size, *self.kv_blocks, self.prefix_queried_tokens, self.prefix_hit_tokens,
                       self.preemptions)

    def add(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str, adapter: int = 0) -> None:
        """Queues a request; it joins the batch at a coming step. `adapter`: the index its rows are
        routed to (`tprt.lora.routing.AdapterSlots`; 0 = the base model). Raises ValidationError naming the
        field (prompt, max_new_tokens, stop_strings, request_id or a sampling field), through the
        same checks as the front ends' `tprt.engine.request.resolve_sampling`."""
        self._require_driver()
        prompt = self._check_request(prompt_ids, params, request_id)
        seed = None if params.greedy else (params.seed if params.seed is not None else self._seeds.getrandbits(63))
        seq = Sequence(request_id, prompt, params, seed, self.tokenizer, self.eos_token_ids, self.ctx.device, adapter)
        seq.cache_key = (adapter, self._adapter_versions.get(adapter, 0))
        if params.constraint is not None:
            outputs = self.structured_outputs
            seq.matcher = outputs.matcher(outputs.compile(params.constraint))
        self._by_id[request_id] = seq
        self._waiting.append(seq)

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

    def forget_prefixes(self, adapter: int) -> None:
        """The weights of adapter index `adapter` changed (an adapter reloaded under its index):
        keys and values computed with the old ones are never reused."""
        self._adapter_versions[adapter] = self._adapter_versions.get(adapter, 0) + 1

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
        if seq.status is Status.WAITING:
            self._waiting.remove(seq)
        self._release(seq)
        self._pending.append(TokenEvent(request_id, None, "", finish_reason="cancelled", usage=seq.usage()))
        return True

    # ----------------------------------------------------------------- stepping

    def step(self) -> list[TokenEvent]:
        """Plans one step, has every rank execute it, samples; returns this step's events.

        Collective over the TP group when there is model work (every follower must be in
        `follow()`); a step with nothing to run only returns pending cancellations."""
        self._require_driver()
        events, self._pending = self._pending, []
        plan, prefill_rows, decode_rows = self._schedule()
        if plan.empty:
            return events
        send_step(plan, self.ctx)
        # Constrained rows' masks depend only on the output so far: computed while the model runs.
        constrained = [s for s in [*(s for s, n in prefill_rows if s.num_computed + n == s.prefill_target),
                                   *decode_rows] if s.matcher is not None]
        masks = self._mask_worker().start(constrained) if constrained else None
        result = self.runner.execute(plan)
        allowed = masks.result() if masks is not None else {}
        if plan.prefill is not None and result.prefill is not None:
            events += self._after_prefill(plan.prefill, prefill_rows, result.prefill, allowed)
        if plan.decode is not None and result.decode is not None:
            for seq in decode_rows:
                self._computed(seq, 1)
            events += self._choose(decode_rows, list(range(len(decode_rows))), result.decode, allowed)
        return events

    def _mask_worker(self) -> MaskWorker:
        if self._masker is None:
            self._masker = MaskWorker(self.structured_outputs)
        return self._masker

    def follow(self) -> Tag:
        """On ranks other than 0: executes rank 0's plans (and waits through its keepalives) until
        it sends anything else; returns that message's tag: EXIT after `close()`, or COMMAND
        (tprt.distributed.ranks.follower_loop receives and runs the command)."""
        if self.is_driver:
            raise RuntimeError("Engine.follow() is for TP ranks other than 0")
        while True:
            header = receive_header(self.ctx)
            if header.tag is Tag.STEP:
                self.runner.execute(StepPlan.decode_from(receive_step(header, self.ctx)))
            elif header.tag is not Tag.KEEPALIVE:
                return header.tag

    def close(self) -> None:
        """Rank 0: releases the followers, whose `follow()` returns EXIT (collective; once, idempotent)."""
        if self.is_driver and not self._closed:
            send_signal(Tag.EXIT, self.ctx)
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

    # ----------------------------------------------------------------- scheduling

    def _schedule(self) -> tuple[StepPlan, list[tuple[Sequence, int]], list[Sequence]]:
        """This step's plan, the prefill rows as (sequence, chunk length) and the decode rows.

        Admitted sequences, oldest first, each get the blocks for this step's tokens: one token
        per decoding sequence, then prefill chunks from what is left of the token budget. When
        the pool runs dry, the most recently admitted sequences are preempted (`_preempt`), so
        the oldest always progress and admitted work finishes. Then waiting sequences are
        admitted in order while the budget, `max_batch` and free blocks last (admission never
        preempts). The prefill batch is right-padded to its longest chunk, so the budget bounds
        its padded size (rows x width): many short rows beside a long one would otherwise
        compute mostly padding."""
        decode_rows: list[Sequence] = []
        prefill_rows: list[tuple[Sequence, int]] = []
        total = self.config.token_budget - sum(s.status is Status.RUNNING for s in self._running)
        budget, width = total, 0

        def widest() -> int:  # the longest chunk another prefill row may have (0: no row fits)
            cap = min(budget, total // (len(prefill_rows) + 1))
            return cap if cap >= width else 0

        i = 0
        while i < len(self._running):  # preemption removes from the end
            seq = self._running[i]
            if seq.status is Status.RUNNING:
                if self._grow(seq, seq.length):  # the input token goes at position length - 1
                    decode_rows.append(seq)
            elif widest() > 0:
                room = (len(seq.blocks) + self._pool.available) * self._pool.block_size - seq.num_computed
                n = min(seq.prefill_target - seq.num_computed, widest(), max(room, 1))
                if self._grow(seq, seq.num_computed + n):
                    prefill_rows.append((seq, n))
                    budget, width = budget - n, max(width, n)
            i += 1
        while self._waiting and widest() > 0 and len(self._running) < self.config.max_batch:
            n = self._admit(self._waiting[0], widest())
            if not n:
                break
            prefill_rows.append((self._running[-1], n))
            budget, width = budget - n, max(width, n)
        prefill = None
        if prefill_rows:
            prefill = BatchPlan(
                tables=tuple(tuple(s.blocks) for s, _ in prefill_rows),
                starts=tuple(s.num_computed for s, _ in prefill_rows),
                tokens=tuple(tuple(s.tokens(s.num_computed + n)[s.num_computed :]) for s, n in prefill_rows),
                full_logits=any(s.needs_logits for s, n in prefill_rows if s.num_computed + n == s.prefill_target),
                adapters=_adapters([s for s, _ in prefill_rows]),
            )
        decode = None
        if decode_rows:
            decode = BatchPlan(
                tables=tuple(tuple(s.blocks) for s in decode_rows),
                starts=tuple(s.length - 1 for s in decode_rows),
                tokens=tuple((s.output[-1],) for s in decode_rows),
                full_logits=any(s.needs_logits for s in decode_rows),
                adapters=_adapters(decode_rows),
            )
        return StepPlan(prefill, decode), prefill_rows, decode_rows

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Gives an admitted sequence the blocks for `tokens` positions, preempting the most
        recently admitted sequences while the pool is short; False when seq itself was the one
        preempted (it then waits at the head of the queue)."""
        while not self._pool.grow(seq.blocks, tokens):
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Frees an admitted sequence's blocks and queues it first, to be recomputed: its prompt
        and output so far are prefilled again (its full blocks stay cached for that, until
        evicted) and sampling continues where it stopped."""
        self._pool.release(seq.blocks)
        seq.digests.clear()
        seq.num_computed = 0
        seq.prefill_target = seq.length
        seq.status = Status.WAITING
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        self.preemptions += 1

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admits the waiting `seq` with its first chunk of at most `budget` tokens (after the
        longest prefix of named blocks it can reuse); returns the chunk's length, 0 when the pool
        cannot hold even one more token now."""
        tokens = seq.tokens(seq.prefill_target)
        # The last token is always computed, for its logits.
        blocks, digests = self._pool.match(tokens, seq.cache_key, seq.prefill_target - 1)
        start = len(blocks) * self._pool.block_size
        room = (len(blocks) + self._pool.available) * self._pool.block_size - start
        n = min(seq.prefill_target - start, budget, room)
        if n <= 0 or not self._pool.grow(blocks, start + n):
            self._pool.release(blocks)
            return 0
        self.prefix_queried_tokens += seq.prefill_target
        self.prefix_hit_tokens += start
        seq.blocks, seq.digests = blocks, digests
        seq.num_computed = start
        if not seq.output:
            seq.cached_prompt_tokens = start
        seq.status = Status.PREFILLING
        self._waiting.popleft()
        self._running.append(seq)
        return n

    def _computed(self, seq: Sequence, n: int) -> None:
        """n more of seq's tokens are in its blocks: the blocks they fill get their names."""
        seq.num_computed += n
        if seq.num_computed // self._pool.block_size > len(seq.digests):
            self._pool.name(seq.blocks, seq.digests, seq.computed_tokens(), seq.cache_key)

    def _release(self, seq: Sequence) -> None:
        self._pool.release(seq.blocks)
        if seq in self._running:
            self._running.remove(seq)
        seq.status = Status.FINISHED
        self._by_id.pop(seq.request_id, None)

    # ----------------------------------------------------------------- sampling and events

    def _after_prefill(self, batch: BatchPlan, rows: list[tuple[Sequence, int]],
                       result: BatchResult, allowed: dict[str, torch.Tensor]) -> list[TokenEvent]:
        """Advances each row past its chunk; rows that finished their prompt get a first token."""
        done_seqs, done_rows = [], []
        for i, (seq, n) in enumerate(rows):
            self._computed(seq, n)
            if seq.num_computed == seq.prefill_target:
                seq.status = Status.RUNNING
                done_seqs.append(seq)
                done_rows.append(i)
        return self._choose(done_seqs, done_rows, result, allowed) if done_seqs else []

    def _choose(self, seqs: list[Sequence], rows: list[int], result: BatchResult,
                allowed: dict[str, torch.Tensor]) -> list[TokenEvent]:
        """Picks the next token of each sequence from its batch row (constrained ones among the
        tokens `allowed[request_id]` allows); returns their events."""
        logprobs: list[float] | None = None
        tops: list[list[tuple[int, float]]] = [[] for _ in seqs]
        if result.logits is None:
            assert result.ids is not None
            ids = result.ids.tolist()
            ids = [ids[r] for r in rows]
        else:
            all_rows = rows == list(range(result.logits.shape[0]))
            logits = result.logits if all_rows else result.logits[torch.tensor(rows, device=result.logits.device)]
            mask = _allowed_rows(seqs, allowed, logits.shape[-1], logits.device, self.eos_token_ids)
            chosen = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], [s.history() for s in seqs],
                            mask)
            ids, logprobs = chosen.token_ids.tolist(), chosen.logprobs.tolist()
            if chosen.top_ids.shape[1]:
                top_ids, top_lps = chosen.top_ids.tolist(), chosen.top_logprobs.tolist()
                tops = [list(zip(top_ids[i], top_lps[i])) for i in range(len(seqs))]
        events = []
        for i, seq in enumerate(seqs):
            out = seq.append(ids[i])
            p = seq.params
            finished = out.finish_reason is not None
            events.append(TokenEvent(
                seq.request_id, ids[i], out.text,
                logprob=logprobs[i] if logprobs is not None and p.logprobs else None,
                top_logprobs=tuple(tops[i][: p.top_logprobs]) if p.logprobs else (),
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                usage=seq.usage() if finished else None,
            ))
            if finished:
                self._release(seq)
        return events


class MaskWorker:
    """Computes constrained sequences' next-token masks on a thread of its own, so that they are
    ready when the step's logits are (llguidance releases the GIL while it computes)."""

    def __init__(self, outputs: StructuredOutputs) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._outputs = outputs
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tprt-masks")

    def start(self, seqs: list[Sequence]) -> Future[dict[str, torch.Tensor]]:
        return self._pool.submit(self._masks, seqs)

    def _masks(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        words = self._outputs.bitmask(len(seqs))
        for i, seq in enumerate(seqs):
            assert seq.matcher is not None
            seq.matcher.fill_bitmask(words[i])
        allowed = bits_to_bool(words, self._outputs.vocab_size)
        return {seq.request_id: allowed[i] for i, seq in enumerate(seqs)}


def _allowed_rows(seqs: list[Sequence], allowed: dict[str, torch.Tensor], vocab: int, device: torch.device,
                  eos_token_ids: Seq[int]) -> torch.Tensor | None:
    """[rows, vocab] bool for `sample`: constrained rows their mask (never a token past the
    tokenizer's vocabulary), the others everything; None when no row is constrained. A row whose
    constraint allows nothing (its matcher hit a limit) may only end: EOS."""
    if not any(s.request_id in allowed for s in seqs):
        return None
    mask = torch.ones(len(seqs), vocab, dtype=torch.bool)
    for i, seq in enumerate(seqs):
        row = allowed.get(seq.request_id)
        if row is not None:
            n = min(vocab, row.shape[0])
            mask[i, :n] = row[:n]
            mask[i, n:] = False
            if not mask[i].any():
                mask[i, [t for t in eos_token_ids if t < vocab][:1]] = True
    return mask.to(device)


def _adapters(rows: list[Sequence]) -> tuple[int, ...]:
    """Each row's adapter index for a BatchPlan; () when every row is the base model."""
    adapters = tuple(s.adapter for s in rows)
    return adapters if any(adapters) else ()


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


def _free_memory_tokens(model: TPLlamaForCausalLM, config: EngineConfig) -> int | None:
    """With gpu_memory_fraction on CUDA (and no kv_cache_tokens): the KV positions that fit in
    that share of the device memory free now (after the weights), the smallest over the TP
    ranks so every rank's pool is the same (collective). None otherwise."""
    fraction, ctx = config.gpu_memory_fraction, model.tp
    if fraction is None or config.kv_cache_tokens is not None or ctx.device.type != "cuda":
        return None
    if not 0 < fraction <= 1:
        raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
    cfg, dtype = model.config, config.cache_dtype or model.default_cache_dtype()
    per_token = cfg.num_hidden_layers * 2 * model.layout.local_kv_heads * cfg.head_dim * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(ctx.device)
    tokens = torch.tensor([int(free * fraction) // per_token], device=ctx.device)
    if ctx.world_size > 1:
        torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MIN, group=ctx.group)
    return int(tokens)


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
